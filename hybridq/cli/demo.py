"""``hybridq demo`` and ``hybridq chaos``: the demo and the fault-injection harness (``hybridq.testing``)."""

from __future__ import annotations

import sys

import click

from hybridq.cli.options import (
    EXIT_ERROR,
    _fail,
)
from hybridq.errors import HybridqError


@click.command()
@click.option("--jobs", default=1000, show_default=True, type=click.IntRange(10, 1_000_000))
@click.option("--dir", "directory", type=click.Path(file_okay=False), help="Keep the demo's files here.")
@click.pass_context
def demo(ctx: click.Context, jobs: int, directory: str | None) -> None:
    """Run hybridq end to end on this machine, with faults, and print a tally.

    Starts a private redis-server (from PATH, or the `embedded` extra; no persistence), the
    forwarder and two `hybridq worker`s; enqueues JOBS jobs while Redis is stopped for a while,
    then SIGKILLed and restarted empty, and the forwarder is SIGKILLed once; then counts what ran
    from an effects file the tasks write. Everything it starts, it stops; everything it writes is
    under one directory it names. Exit 0 when nothing was lost.

    \b
    Example:
      hybridq demo --jobs 1000
    """
    from hybridq.testing.demo import run_demo  # noqa: PLC0415

    try:
        with click.progressbar(length=jobs, label="enqueue", file=sys.stderr) as bar:
            result = run_demo(
                jobs=jobs,
                directory=directory,
                say=lambda m: click.echo(f"\n{m}", err=True),
                progress=bar.update,
            )
    except (HybridqError, OSError) as exc:
        _fail(ctx, exc)
    click.echo(
        f"accepted={result.accepted} succeeded={result.succeeded} ran={result.ran} lost={result.lost} "
        f"duplicate_deliveries={result.duplicate_runs + result.duplicates_suppressed} "
        f"duplicate_runs={result.duplicate_runs} duplicates_suppressed={result.duplicates_suppressed} "
        f"seconds={result.seconds:.1f}"
    )
    click.echo(f"files: {result.directory}")
    if result.duplicate_runs:
        click.echo(
            f"{result.duplicate_runs} job(s) ran twice: they had finished, and Redis was wiped before the "
            "forwarder recorded them in its ledger (the one window where a finished job runs again; see "
            "docs/guarantees.md).",
            err=True,
        )
    if result.lost:
        ctx.exit(EXIT_ERROR)


def _fault_list(_ctx: click.Context, _param: click.Parameter, value: str) -> tuple[str, ...]:
    from hybridq.testing.chaos import FAULTS  # noqa: PLC0415

    names = tuple(n.strip() for n in value.split(",") if n.strip())
    if value.strip() == "all":
        return tuple(FAULTS)
    unknown = [n for n in names if n not in FAULTS]
    if unknown or not names:
        raise click.BadParameter(
            f"unknown fault(s) {', '.join(unknown) or '(none)'}; known: {', '.join(FAULTS)}"
        )
    return names


@click.command()
@click.option(
    "--duration",
    default=60.0,
    show_default=True,
    type=click.FloatRange(5, 7 * 86400),
    help="Seconds of faults (the soak tier: 1800 or more).",
)
@click.option(
    "--seed",
    type=int,
    default=None,
    help="Seed of the fault schedule and the load (default: random, printed).",
)
@click.option(
    "--faults",
    default="all",
    show_default=True,
    callback=_fault_list,
    help="Comma-separated fault names, or all.",
)
@click.option(
    "--producers", default=2, show_default=True, type=click.IntRange(1, 32), help="Producer processes."
)
@click.option(
    "--workers",
    default=3,
    show_default=True,
    type=click.IntRange(1, 64),
    help="Worker processes (hybridq worker and rq worker, alternating).",
)
@click.option(
    "--rate",
    default=10.0,
    show_default=True,
    type=click.FloatRange(0.1, 10_000),
    help="Jobs per second per producer.",
)
@click.option(
    "--gap",
    default=3.0,
    show_default=True,
    type=click.FloatRange(0.1, 3600),
    help="Mean seconds between faults.",
)
@click.option(
    "--lease",
    default=2.0,
    show_default=True,
    type=click.FloatRange(0.5, 3600),
    help="The forwarder's --lease.",
)
@click.option(
    "--drain",
    default=180.0,
    show_default=True,
    type=click.FloatRange(1, 86400),
    help="Seconds the drain after the last fault may go without a job finishing; what is left then is lost.",
)
@click.option("--report", type=click.Path(dir_okay=False), help="Also write the verdict as JSON here.")
@click.option(
    "--dir",
    "directory",
    type=click.Path(file_okay=False),
    help="Keep the run's files here (kept anyway on failure).",
)
@click.pass_context
def chaos(
    ctx: click.Context,
    duration: float,
    seed: int | None,
    faults: tuple[str, ...],
    producers: int,
    workers: int,
    rate: float,
    gap: float,
    lease: float,
    drain: float,
    report: str | None,
    directory: str | None,
) -> None:
    """Prove the guarantees on this machine: real processes, injected faults, an independent tally.

    Starts a private redis-server (no persistence), the forwarder, WORKERS workers (`hybridq
    worker` and plain `rq worker`, alternating) and PRODUCERS producer processes, then injects a
    seeded schedule of faults (docs/reliability.md S1, S2, S8-S12): producer kills and crash points,
    forwarder kills, worker and work-horse kills, Redis restarted empty, FLUSHALL, an evicting
    maxmemory, Redis stopped, SIGSTOPped and CLIENT PAUSEd, and network faults between the
    clients and Redis (latency, resets, a blackhole, replies cut). Jobs note their runs in a file of
    their own, so the verdict does not trust hybridq's counts. Prints one figure line per fault
    class and a total; exits 1 if an acknowledged job was lost, failed for good, or ran again
    after it had finished (and prints the seed to replay it), 0 otherwise. See
    docs/reliability.md.

    \b
    Faults: producer-kill producer-crash forwarder-kill worker-kill horse-kill redis-restart
            flushall evict redis-outage redis-sigstop client-pause net-latency net-reset
            net-blackhole net-cut
    \b
    Examples:
      hybridq chaos                                  # a minute of every fault
      hybridq chaos --duration 1800 --seed 42        # the soak tier
      hybridq chaos --faults redis-restart,flushall --seed 7 --duration 30
    """
    import random  # noqa: PLC0415

    from hybridq.testing.chaos import ChaosConfig  # noqa: PLC0415
    from hybridq.testing.chaos import main as chaos_main  # noqa: PLC0415

    cfg = ChaosConfig(
        duration_s=duration,
        seed=seed if seed is not None else random.SystemRandom().randrange(1, 1 << 31),
        faults=faults,
        producers=producers,
        workers=workers,
        rate=rate,
        gap_s=gap,
        lease_s=lease,
        drain_s=drain,
        directory=directory,
    )
    try:
        code = chaos_main(cfg, echo=click.echo, report=report)
    except (HybridqError, OSError) as exc:
        _fail(ctx, exc)
    ctx.exit(code)
