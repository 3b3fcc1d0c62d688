from actloop.rewards.base import RewardError, call_reward_func, load_reward_func
from actloop.rewards.flags import Flag, Grade, Policy
from actloop.rewards.rubric import RewardTerm, Rubric

__all__ = ["Flag", "Grade", "Policy", "RewardError", "RewardTerm", "Rubric", "call_reward_func", "load_reward_func"]
