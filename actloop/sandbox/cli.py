"""``actloop sandbox ...``: run a file in the sandbox; say which tier works here and why.

Mounted by the main CLI with ``app.add_typer(sandbox_app, name="sandbox")``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import typer

from .base import IsolationUnavailableError, Limits, SandboxError
from .docker import DEFAULT_IMAGE
from .docker import build_image as build_docker_image
from .factory import diagnose, get_sandbox

app = typer.Typer(help="Run code in the sandbox and check which isolation tier works here.",
                  no_args_is_help=True)


@app.command()
def run(
    file: Path = typer.Argument(..., exists=True, dir_okay=False, readable=True,
                                help="Python file to run (as main.py in the sandbox)."),
    timeout: float = typer.Option(Limits.timeout_s, "--timeout", min=0.01, help="Wall-clock limit, seconds."),
    memory_mb: int = typer.Option(Limits.memory_mb, "--memory-mb", min=1, help="Address-space limit, MiB."),
    backend: str = typer.Option("auto", "--backend", help="auto | bwrap | rlimit | docker"),
    image: str | None = typer.Option(None, "--image",
                                     help="Docker image (needs python3; default: sandbox.docker_image, "
                                          "made by `actloop sandbox build-image`)."),
    require_isolation: bool = typer.Option(False, "--require-isolation",
                                           help="Fail instead of falling back to the rlimit tier."),
    stdin_file: Path | None = typer.Option(None, "--stdin", exists=True, dir_okay=False,
                                           help="File fed to the program's stdin."),
    as_json: bool = typer.Option(False, "--json", help="Print the ExecResult as one JSON line."),
) -> None:
    """Run FILE once and report. The exit status is the program's."""
    if image is not None and backend != "docker":
        typer.echo("error: --image is for --backend docker", err=True)
        raise typer.Exit(1)
    try:
        kwargs = {"image": image or _default_image()} if backend == "docker" else {}
        sb = get_sandbox(backend, require_isolation=require_isolation, **kwargs)
    except (SandboxError, ValueError) as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2 if isinstance(e, IsolationUnavailableError) else 1) from None
    limits = Limits(timeout_s=timeout, memory_mb=memory_mb)
    stdin = stdin_file.read_bytes() if stdin_file is not None else None
    res = sb.run(file.read_text(), stdin=stdin, limits=limits)
    if res.error and not as_json:
        typer.echo(f"error: the sandbox failed: {res.error}", err=True)
    if as_json:
        typer.echo(res.to_json())
    else:
        sys.stdout.write(res.stdout)
        sys.stdout.flush()
        sys.stderr.write(res.stderr)
        flags = [f for f in ("timed_out", "oom", "truncated") if getattr(res, f)]
        typer.echo(
            f"[tier={res.tier} exit={res.exit_code} {res.duration_s * 1000:.0f} ms"
            + (f" {' '.join(flags)}" if flags else "") + "]",
            err=True,
        )
    raise typer.Exit(res.exit_code if res.exit_code < 256 else 1)


def _default_image() -> str:
    """`DEFAULT_IMAGE`, the default of the config key `sandbox.docker_image` too."""
    return DEFAULT_IMAGE


@app.command()
def doctor(
    docker: bool = typer.Option(True, "--docker/--no-docker", help="Also check the Docker tier (daemon, image, a run)."),
    image: str | None = typer.Option(None, "--image", help="Docker image to check (default: sandbox.docker_image)."),
    require_isolation: bool = typer.Option(False, "--require-isolation",
                                           help="Exit 1 if no isolating tier works."),
) -> None:
    """Say which sandbox tier `auto` picks on this machine, and why the others do not work."""
    from rich.console import Console
    from rich.table import Table

    statuses = diagnose(docker=docker, image=image or _default_image())
    table = Table(title="actloop sandbox tiers")
    for col in ("tier", "available", "isolates", "why"):
        table.add_column(col)
    for s in statuses:
        table.add_row(s.tier, "yes" if s.available else "no", "yes" if s.isolated else "NO", s.reason)
    console = Console(width=max(120, Console().width))
    console.print(table)
    bwrap = statuses[0]
    if bwrap.available:
        console.print("auto -> [bold green]bwrap[/] (namespace isolation)")
    else:
        console.print(f"auto -> [bold red]rlimit[/] (NO isolation; require_isolation=True would refuse), because "
                      f"bwrap does not work here: {bwrap.reason}")
    if require_isolation and not any(s.available and s.isolated for s in statuses):
        raise typer.Exit(1)


@app.command("build-image")
def build_image(
    image: str | None = typer.Option(None, "--image", help="Name of the image (default: sandbox.docker_image)."),
    suite: str = typer.Option("bookworm", "--suite", help="Debian release to bootstrap."),
    mirror: str = typer.Option("http://deb.debian.org/debian", "--mirror", help="Debian mirror (a local one works)."),
    force: bool = typer.Option(False, "--force", help="Rebuild even if the image is present."),
) -> None:
    """Make the Docker tier's image offline: debootstrap (Debian minbase + python3) then
    `docker import`. No registry needed; cached (a present image is kept). Needs root."""
    try:
        build_docker_image(image or _default_image(), suite=suite, mirror=mirror, force=force, log_fn=typer.echo)
    except SandboxError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(1) from None
