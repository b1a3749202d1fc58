"""``hybridq journal``: verify, repair and dump the journal directory."""

from __future__ import annotations

import base64
import json
import os
import sys
from collections.abc import Callable
from typing import Any

import click

from hybridq.cli.options import (
    EXIT_CORRUPT,
    _fail,
    _reader_left,
    journal_option,
)
from hybridq.errors import HybridqError
from hybridq.journal.reader import JournalReader, segment_usage
from hybridq.journal.recovery import verify

#: Journals larger than this get a progress bar on stderr.
PROGRESS_THRESHOLD_BYTES = 16 << 20


@click.group()
def journal() -> None:
    """Inspect the journal directory.

    \b
    Example:
      hybridq journal verify --journal ./hybridq-journal
    """


def _progress(total: int) -> tuple[Callable[[int], None] | None, Callable[[], None]]:
    """A stderr progress bar over ``total`` bytes when the journal is large, else nothing."""
    if total < PROGRESS_THRESHOLD_BYTES:
        return None, lambda: None
    bar = click.progressbar(length=total, label="scanning", file=sys.stderr, show_pos=False)
    bar.__enter__()
    return bar.update, lambda: bar.__exit__(None, None, None)


@journal.command("verify")
@journal_option
@click.option("--json", "as_json", is_flag=True, help="Print the result as one JSON object.")
@click.pass_context
def journal_verify(ctx: click.Context, journal: str, as_json: bool) -> None:
    """Check every record of the journal; exit 0 when healthy, 3 when corrupt.

    Read-only: a torn tail left by a crashed producer is reported (it is repaired when the
    forwarder next opens the journal); corruption is reported with the file, the byte offset
    and the records affected.

    \b
    Example:
      hybridq journal verify --journal ./hybridq-journal
    """
    on_bytes, done = _progress(segment_usage(journal)[1])
    from hybridq.ops.ids_repair import check_ids  # noqa: PLC0415

    try:
        report = verify(journal, on_bytes=on_bytes)
        check_ids(journal)  # the ledger's ids files (docs/journal.md): damaged, they stop the forwarder
    except (HybridqError, OSError) as exc:
        done()
        _fail(ctx, exc)
    done()
    if as_json:
        out: dict[str, Any] = {
            "ok": True,
            "chains": report.chains,
            "segments": report.segments,
            "records": report.records,
            "bytes": report.bytes,
            "live_writers": report.live_chains,
            "torn_tails": [
                {"path": t.path, "offset": t.offset, "dropped_bytes": t.dropped_bytes}
                for t in report.torn_tails
            ],
        }
        click.echo(json.dumps(out))
        return
    click.echo(
        f"ok: {report.records} records in {report.segments} segments "
        f"({report.chains} writers, {report.live_chains} live), {report.bytes} bytes"
    )
    for torn in report.torn_tails:
        click.echo(
            f"torn tail: {torn.path} at offset {torn.offset}, {torn.dropped_bytes} bytes "
            "(left by a crash; never acknowledged; repaired when the journal is next opened)"
        )


@journal.command("repair")
@journal_option
@click.option(
    "--accept-loss",
    is_flag=True,
    help="Change the journal: drop the damaged records (and what follows them) as listed. Without "
    "it, a dry run: report what would be dropped, change nothing.",
)
@click.option("--json", "as_json", is_flag=True, help="Print the full report (every dropped record) as JSON.")
@click.pass_context
def journal_repair(ctx: click.Context, journal: str, accept_loss: bool, as_json: bool) -> None:
    """Repair mid-file damage that stops the forwarder (exit 3), by dropping the damaged records.

    A dry run by default: it lists, per damaged chain, where the damage is and exactly which
    records would be dropped, and changes nothing (exit 3 if anything would be dropped, 0 if the
    journal is healthy). With --accept-loss it backs up every file it changes or removes into
    repair-backup-<time>/ (with repair-report.json listing every dropped record), cuts the
    damaged segment after its last good record, seals it, and moves what follows aside. The
    ledger (ledger/) and the key store (keys/) are checked the same way. A running forwarder
    must be stopped first.

    \b
    Examples:
      hybridq journal repair --journal /var/lib/hybridq/journal
      hybridq journal repair --accept-loss --journal /var/lib/hybridq/journal
    """
    from hybridq.ops.journal_repair import repair  # noqa: PLC0415

    reports = []
    for path in (journal, os.path.join(journal, "ledger"), os.path.join(journal, "keys")):
        if path != journal and not os.path.isdir(path):
            continue
        on_bytes, done = _progress(segment_usage(path)[1])
        try:
            reports.append(repair(path, accept_loss=accept_loss, progress=on_bytes))
        except (HybridqError, OSError) as exc:
            done()
            _fail(ctx, exc)
        done()
    if as_json:
        click.echo(json.dumps([r.to_dict() for r in reports]))
    else:
        for report in reports:
            _print_repair(report)
    damaged = any(not r.healthy for r in reports)
    if damaged and not accept_loss:
        ctx.exit(EXIT_CORRUPT)


def _print_repair(report: Any) -> None:
    if report.healthy:
        click.echo(f"{report.path}: healthy ({report.segments} segments): nothing to repair")
        return
    verb = "dropped" if report.applied else "would drop"
    for chain in report.repairs:
        seqs = [d for d in chain.dropped if d.seq is not None]
        span = f", sequence numbers {seqs[0].seq}..{seqs[-1].last_seq or seqs[-1].seq}" if seqs else ""
        click.echo(
            f"{chain.path} at offset {chain.offset}: {chain.reason}: {verb} {chain.data_records_dropped} "
            f"record(s){span} ({chain.bytes_dropped} bytes); {len(chain.truncated)} segment(s) cut, "
            f"{len(chain.removed)} moved aside"
        )
    if report.applied:
        click.echo(f"backup (every changed file, and repair-report.json): {report.backup}")
    else:
        click.echo(
            "dry run: nothing changed. Run again with --accept-loss to drop the records listed (--json: all)."
        )


@journal.command("dump")
@journal_option
@click.pass_context
def journal_dump(ctx: click.Context, journal: str) -> None:
    """Print every record as one JSON line: writer, seq, type, segment, offset, payload.

    The payload is printed as text when it is UTF-8, else base64 in ``payload_b64``.

    \b
    Example:
      hybridq journal dump --journal ./hybridq-journal | head
    """
    try:
        reader = JournalReader(journal)
        for rec in reader.records():
            line: dict[str, Any] = {
                "writer": rec.writer_id,
                "seq": rec.seq,
                "type": rec.rtype,
                "segment": rec.segment_index,
                "offset": rec.offset,
            }
            try:
                line["payload"] = rec.payload.decode()
            except UnicodeDecodeError:
                line["payload_b64"] = base64.b64encode(rec.payload).decode()
            try:
                click.echo(json.dumps(line))
            except BrokenPipeError:
                _reader_left(ctx)
    except (HybridqError, OSError) as exc:
        _fail(ctx, exc)
