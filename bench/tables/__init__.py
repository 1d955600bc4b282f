"""Markdown tables of runners' JSON that bench/report.py dispatches to (one module per runner), and
the head line they share."""


def run_line(env: dict, *versions: str, gpus: int = 1) -> str:
    """The head of a runner's table: GPU (and count), torch, triton, any other
    ``versions``, and the time of the run (UTC, to the minute), or of each run
    where :func:`merge_runs` put rows of several together."""
    gpu = env["gpu"] if gpus == 1 else f"{env['gpu']} x {gpus}"
    when = env["date"][:16].replace("T", " ")
    if len(env.get("runs", ())) > 1:
        dates = ", ".join(r[:16].replace("T", " ") for r in env["runs"])
        when = f"runs of {dates} UTC (each row's date in the JSON)"
    return " | ".join([gpu, f"torch {env['torch']}", f"triton {env['triton']}", *versions, when])


def shape_name(shape) -> str:
    """``[1, 24, 4608, 128]`` as ``1x24x4608x128``."""
    return "x".join(str(d) for d in shape)
