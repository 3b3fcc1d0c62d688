# The reward function from the blog post actloop grew from, copied unchanged.
def reasoning_reward_func(prompts, completions, answer_keys, **kwargs):
    rewards = []
    for completion, key in zip(completions, answer_keys):
        if "<thought>" in completion and "</thought>" in completion:
            if key in completion.split("### Final Answer")[-1]:
                rewards.append(2.0)
            else:
                rewards.append(0.5)
        else:
            rewards.append(-1.0)
    return rewards
