"""Coverage-guided fuzzing (atheris, libFuzzer) of the decoders that read outside bytes.

Run it through ``scripts/fuzz`` (see ``docs/security.md``, *Sizes are capped*). The properties are
those of ``tests/unit/test_fuzz.py`` (Hypothesis), checked on inputs that libFuzzer mutates
towards new branches of the instrumented ``hybridq`` code:

``reader``
    The input is written as a segment file and read as a sealed segment (0400) and as the last,
    unsealed segment of a dead writer (0600: the torn-tail policy); then the same again with its
    checksums recomputed, so that mutations get past the CRC. Only the journal's typed errors
    may come out, and no input may make the reader ask for memory by a length it has not checked
    (the address space is capped at 1 GiB: MemoryError is a finding). Every record yielded must be in the file, byte for byte, where the
    reader says, with a valid salted checksum, in an unbroken run from the file header; a read
    that ends cleanly accounts for every byte (seal, torn tail or end of file); ``check()`` and
    ``records()`` agree. "Was written" is checked through the bytes, not against the template's
    payloads: libFuzzer sees the checksum comparison and can forge a record that passes it, and
    a forged record that passes its checksum is indistinguishable from a written one.
``envelope``
    ``Envelope.from_bytes`` raises only ``EnvelopeError``; whatever decodes re-encodes and
    decodes to the same envelope, and becomes an RQ job hash (``RQTransport.job_hash``) without
    error, every field one redis-py encodes, every number one RQ takes (issue 13.2).
``event``
    A completion event as the forwarder reads it from Redis: it parses into a ledger entry that
    encodes as strict JSON and decodes to itself, or raises only what the forwarder drops an
    event for (``tests.support.fuzzing.check_event``).

The seed corpus (valid journals, cut, unsealed, damaged; valid envelopes and events) is
generated at start.
The run stops after ``--seconds`` with a summary line on stdout and exit status 0; a finding
makes libFuzzer write ``crash-*`` (``oom-*``, ``timeout-*``) into ``--artifacts`` and exit non-zero.
An input file given after the options is run once (to reproduce a finding).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import struct
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import atheris

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # tests.support: the template journal shared with test_fuzz.py

with atheris.instrument_imports(include=["hybridq"]):
    from hybridq.envelope.model import Envelope, Retry
    from hybridq.errors import EnvelopeError, JournalError
    from hybridq.journal import JournalReader
    from hybridq.journal.format import (
        FILE_HEADER_SIZE,
        MAX_PAYLOAD_BYTES,
        RECORD_HEADER_SIZE,
        SEAL_PAYLOAD_SIZE,
        SEAL_RECORDS,
        crc32c,
        decode_segment_header,
        salt_seed,
        segment_name,
    )
    from hybridq.journal.records import Record
    from tests.support.fuzzing import check_event, check_job_hash, make_template_journal, write_segment

_RECORD_HEADER = struct.Struct("<IIQI")  # crc, length, sequence, type word (docs/journal-format.md)
_SEAL_BYTES = SEAL_RECORDS * (RECORD_HEADER_SIZE + SEAL_PAYLOAD_SIZE)
_SHORT_INPUT_WRITER = "0" * 16
#: libFuzzer options: an input that uses 1 GiB of RSS (oom-*) or 10 s (timeout-*) is a finding.
_LIBFUZZER_DEFAULTS = {
    "reader": ["-max_len=16384"],
    "envelope": ["-max_len=4096"],
    "event": ["-max_len=2048"],
}
_COMMON = ["-rss_limit_mb=1024", "-timeout=10"]
#: The process's address space (it uses under 100 MB). RSS alone would miss the allocation an
#: unchecked length causes: os.read(fd, 4 GiB) maps pages it never touches. Here it raises.
_ADDRESS_SPACE_BYTES = 1 << 30


class Stats:
    """Counts printed in the summary line."""

    def __init__(self, target: str, seconds: float) -> None:
        self.target = target
        self.start = time.monotonic()
        self.deadline = self.start + seconds
        self.executions = 0
        self.counts: dict[str, int] = {}

    def add(self, name: str, n: int = 1) -> None:
        self.counts[name] = self.counts.get(name, 0) + n

    def tick(self) -> None:
        """Count one execution; past the deadline, print the summary and exit 0."""
        self.executions += 1
        if time.monotonic() >= self.deadline:
            elapsed = time.monotonic() - self.start
            detail = ", ".join(f"{k}={v}" for k, v in sorted(self.counts.items()))
            print(
                f"fuzz {self.target}: {self.executions} executions in {elapsed:.1f} s "
                f"({self.executions / elapsed:.0f}/s), no finding; {detail}",
                flush=True,
            )
            sys.stderr.flush()
            # Ended here, not by libFuzzer's -max_total_time: libFuzzer ends a run with exit()
            # from C, where no Python code runs to print this line.
            os._exit(0)


# -- the journal reader -------------------------------------------------------------------------


class ReaderTarget:
    """Arbitrary bytes as the one segment of a journal directory."""

    def __init__(self, workdir: Path, stats: Stats) -> None:
        self.stats = stats
        self.journal = workdir / "journal"
        shutil.rmtree(self.journal, ignore_errors=True)
        self.journal.mkdir(mode=0o700)
        self.template_dir = workdir / "template"

    def seeds(self) -> dict[str, bytes]:
        """Valid journals and the damage a crash or a bad disk leaves in them."""
        shutil.rmtree(self.template_dir, ignore_errors=True)
        big = bytes(range(256)) * 24
        template = make_template_journal(
            self.template_dir,
            batches=[[b"batch-%d" % i for i in range(6)], [big, b"", b"{}"]],
        )
        raw = template.raw
        unsealed = raw[:-_SEAL_BYTES]
        offsets = _record_offsets(unsealed)  # by sequence number: 1-12 alone, 13-18 one batch
        seeds = {
            "sealed": raw,
            "unsealed": unsealed,
            "one-seal": raw[: -_SEAL_BYTES // 2],
            "torn-mid-record": unsealed[:-7],
            "header-only": raw[:FILE_HEADER_SIZE],
            "flipped-second-record": _flip(raw, offsets[2] + RECORD_HEADER_SIZE + 1),
            # Valid records of the same batch follow it: written before it was durable.
            "flipped-in-a-batch": _flip(unsealed, offsets[14] + RECORD_HEADER_SIZE + 1),
            "zeros-after": unsealed + bytes(300),
        }
        self.stats.add("seeds", len(seeds))
        return seeds

    def __call__(self, data: bytes) -> None:
        self.stats.tick()
        # Named after the writer id in the input's own header, so a crash file reproduces in a
        # new run (whose template has another, random writer id).
        writer = data[12:20].hex() if len(data) >= 20 else _SHORT_INPUT_WRITER
        # Then with every checksum made valid: a mutated sequence number, type, length or seal
        # would almost always stop at "checksum mismatch"; this takes the scan past it.
        fixed = _fix_checksums(data)
        for raw in (data, fixed) if fixed != data else (data,):
            for sealed in (True, False):
                write_segment(self.journal, segment_name(writer, 0), raw, sealed=sealed)
                self._read(raw, sealed=sealed)
        for path in self.journal.iterdir():
            path.unlink()

    def _read(self, data: bytes, *, sealed: bool) -> None:
        reader = JournalReader(self.journal)
        records: list[Record] = []
        error: JournalError | None = None
        try:
            records.extend(reader.records())
        except JournalError as exc:
            error = exc
        checker = JournalReader(self.journal)
        counted, check_error = 0, None
        try:
            counted = checker.check()
        except JournalError as exc:
            check_error = exc
        # The fast path of verify() must come to the same verdict as the reading path.
        assert _verdict(check_error) == _verdict(error), (check_error, error)
        if error is None:
            assert counted == len(records), (counted, len(records))
        end, next_seq = _check_records(data, records)
        self.stats.add("records checked", len(records))
        if error is not None:
            self.stats.add("reads refused")
            return
        self.stats.add("clean reads")
        self.stats.add("torn tails", len(reader.torn_tails))
        _check_clean_end(reader, data, end, next_seq, sealed=sealed)


def _fix_checksums(data: bytes) -> bytes:
    """``data`` with the file header's and each record's checksum recomputed, as far as it frames."""
    if len(data) < FILE_HEADER_SIZE:
        return data
    out = bytearray(data)
    out[60:64] = crc32c(out[:60]).to_bytes(4, "little")  # the header's CRC covers its first 60 bytes
    seed = salt_seed(bytes(out[20:28]))  # the salt (docs/journal-format.md, File header)
    at = FILE_HEADER_SIZE
    while at + RECORD_HEADER_SIZE <= len(out):
        _, length, _, _ = _RECORD_HEADER.unpack_from(out, at)
        end = at + RECORD_HEADER_SIZE + length
        if end > len(out):
            break
        out[at : at + 4] = crc32c(out[at + 4 : end], seed).to_bytes(4, "little")
        at = end
    return bytes(out)


def _verdict(error: JournalError | None) -> tuple[type[JournalError], str] | None:
    return None if error is None else (type(error), str(error))


def _record_offsets(raw: bytes) -> dict[int, int]:
    offsets: dict[int, int] = {}
    at = FILE_HEADER_SIZE
    while at < len(raw):
        _, length, seq, _ = _RECORD_HEADER.unpack_from(raw, at)
        offsets[seq] = at
        at += RECORD_HEADER_SIZE + length
    return offsets


def _flip(raw: bytes, offset: int) -> bytes:
    out = bytearray(raw)
    out[offset] ^= 0x40
    return bytes(out)


def _check_records(data: bytes, records: list[Record]) -> tuple[int, int]:
    """Each record is in ``data`` where the reader says, checksum valid, one after the other.

    Returns the end of the last record (of the header when none) and the next sequence number.
    """
    if not records:
        return FILE_HEADER_SIZE, 0
    header = decode_segment_header(data)  # a record was yielded: the header must be sound
    seed = salt_seed(header.salt)
    at, seq = FILE_HEADER_SIZE, header.first_seq
    for rec in records:
        assert (rec.writer_id, rec.segment_index) == (header.writer_id, header.index), rec
        assert (rec.offset, rec.seq) == (at, seq), (rec.offset, rec.seq, at, seq)
        assert at + RECORD_HEADER_SIZE <= len(data), rec
        crc, length, stored_seq, word = _RECORD_HEADER.unpack_from(data, at)
        end = at + RECORD_HEADER_SIZE + length
        assert length <= MAX_PAYLOAD_BYTES, rec
        assert end <= len(data), rec
        assert rec.end == end, rec
        assert stored_seq == seq, rec
        assert rec.rtype == word & 0xFF, rec
        assert 1 <= rec.rtype <= 127, rec
        assert word >> 8, "a record with an unsynced distance of zero was yielded"
        assert rec.payload == data[at + RECORD_HEADER_SIZE : end], rec
        assert crc32c(data[at + 4 : end], seed) == crc, f"record {seq} failed its checksum"
        at, seq = end, seq + 1
    return at, seq


def _check_clean_end(reader: JournalReader, data: bytes, end: int, next_seq: int, *, sealed: bool) -> None:
    """A read without error accounts for every byte after the last record."""
    if len(data) < FILE_HEADER_SIZE:
        raise AssertionError(f"a {len(data)}-byte segment read without error")
    [info] = reader.chain_ends.values()
    header = decode_segment_header(data)
    next_seq = next_seq or header.first_seq
    if info.torn is not None:
        assert not sealed, "a torn tail in a sealed segment"
        torn = info.torn
        assert (torn.offset, torn.next_seq) == (end, next_seq), (torn, end, next_seq)
        assert torn.offset + torn.dropped_bytes == len(data), torn
        assert reader.torn_tails == [torn]
        return
    assert info.end_offset == len(data), (info, len(data))
    if info.sealed:
        assert end + _SEAL_BYTES == len(data), (end, len(data))
    else:
        assert not sealed, "a sealed segment read to its end without its seal"
        assert end == len(data), (end, len(data))
    assert info.next_seq == next_seq + (SEAL_RECORDS if info.sealed else 0), (info, next_seq)


# -- the envelope decoder -----------------------------------------------------------------------


class EnvelopeTarget:
    """Arbitrary bytes as a journal record's payload, decoded as a job envelope."""

    def __init__(self, stats: Stats) -> None:
        self.stats = stats

    def seeds(self) -> dict[str, bytes]:
        """Envelopes as producers write them, from the fewest fields to every optional one."""
        plain = Envelope("0190a1b2c3d4e5f60718293a4b5c6d7e", "tasks.add", "default", "k-1", 1.7e9, (1, 2))
        full = Envelope(
            "job_1",
            "pkg.mod.Class.method",
            "high.priority",
            "order:42 \u00e9",
            1_700_000_000.25,
            args=("x", [1, 2.5, None], {"nested": {"deep": [True, False]}}),
            kwargs={"a": -1, "b": "\u2603", "c": 1e-300},
            timeout_s=30.0,
            result_ttl_s=0,
            run_at=1_700_000_100.0,
            retry=Retry(max_attempts=5, backoff_s=0.5, backoff_max_s=60, jitter=False),
            description="a description",
            meta={"trace": "abc", "n": 3},
            requeue=2,
            signature="hmac-sha256:" + "ab" * 32,
            extra={"future_field": {"x": [1]}},
        )
        seeds = {"plain": plain.to_bytes(), "full": full.to_bytes(), "not-an-object": b"[1,2]"}
        self.stats.add("seeds", len(seeds))
        return seeds

    def __call__(self, data: bytes) -> None:
        self.stats.tick()
        try:
            env = Envelope.from_bytes(data)
        except EnvelopeError:
            self.stats.add("refused")
            return
        self.stats.add("decoded and round-tripped")
        again = Envelope.from_bytes(env.to_bytes())
        assert again.to_dict() == env.to_dict(), (env, again)
        check_job_hash(env)


# -- completion events --------------------------------------------------------------------------


class EventTarget:
    """Arbitrary bytes as the JSON of a completion event in the forwarder's stream."""

    def __init__(self, stats: Stats) -> None:
        self.stats = stats

    def seeds(self) -> dict[str, bytes]:
        """Events as workers write them: a success, a failure with a retry, a final failure."""
        base = {
            "id": "0190a1b2c3d4e5f60718293a4b5c6d7e",
            "loc": ["a1b2c3d4e5f60718", 3, 4096],
            "queue": "default",
        }
        seeds = {
            "succeeded": {
                **base,
                "outcome": "succeeded",
                "final": True,
                "attempt": 1,
                "dup": False,
                "at": 1.7e9,
            },
            "retry": {
                **base,
                "outcome": "failed",
                "final": False,
                "retry_delay": 2.5,
                "attempt": 2,
                "error": "E",
            },
            "failed": {
                **base,
                "outcome": "failed",
                "final": True,
                "attempt": 3,
                "error": "boom",
                "at": 1.7e9,
            },
        }
        self.stats.add("seeds", len(seeds))
        return {name: json.dumps(body).encode() for name, body in seeds.items()}

    def __call__(self, data: bytes) -> None:
        self.stats.tick()
        self.stats.add("dropped" if check_event(data) is None else "parsed and round-tripped")


def _event_dictionary() -> list[bytes]:
    """JSON tokens and the event's field names, for libFuzzer's -dict."""
    keys = ["id", "loc", "outcome", "final", "attempt", "dup", "error", "retry_delay", "at", "queue"]
    tokens = [json.dumps(k).encode() for k in [*keys, "succeeded", "failed"]]
    return [*tokens, b"true", b"false", b"null", b"NaN", b"Infinity", b"1e400", b"[", b"{", b"e+"]


def _envelope_dictionary() -> list[bytes]:
    """JSON tokens and the envelope's field names, for libFuzzer's -dict (mutations splice them)."""
    keys = ["v", "id", "func", "args", "kwargs", "queue", "key", "created_at", "timeout"]
    keys += ["result_ttl", "run_at", "retry", "description", "meta", "requeue", "sig"]
    keys += ["max_attempts", "backoff", "backoff_max", "jitter"]
    tokens = [json.dumps(k).encode() for k in keys]
    return [*tokens, b"true", b"false", b"null", b"NaN", b"Infinity", b'"\\u', b"[", b"{", b"e+"]


# -- running ------------------------------------------------------------------------------------


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("target", choices=["reader", "envelope", "event"])
    parser.add_argument("--seconds", type=float, default=60.0, help="how long to fuzz (default 60)")
    parser.add_argument("--workdir", type=Path, help="corpus and scratch files (default: a temp dir)")
    parser.add_argument("--artifacts", type=Path, help="where a finding is written (default: --workdir)")
    parser.add_argument("inputs", nargs="*", help="run these input files once instead of fuzzing")
    args, libfuzzer_args = parser.parse_known_intermixed_args(argv)
    workdir: Path = args.workdir or Path(tempfile.mkdtemp(prefix="hybridq-fuzz-"))
    workdir.mkdir(parents=True, exist_ok=True)
    artifacts: Path = args.artifacts or workdir
    artifacts.mkdir(parents=True, exist_ok=True)
    stats = Stats(args.target, args.seconds)
    target: ReaderTarget | EnvelopeTarget | EventTarget
    if args.target == "reader":
        target = ReaderTarget(workdir, stats)
    else:
        target = EnvelopeTarget(stats) if args.target == "envelope" else EventTarget(stats)
    options = [*_COMMON, *_LIBFUZZER_DEFAULTS[args.target], f"-artifact_prefix={artifacts}/"]
    if args.inputs:
        positional = list(args.inputs)
    else:
        corpus = workdir / f"corpus-{args.target}"
        corpus.mkdir(exist_ok=True)
        for name, raw in target.seeds().items():
            (corpus / f"seed-{name}").write_bytes(raw)
        positional = [str(corpus)]
        # A backstop only: Stats.tick ends the run on time with the summary line.
        options.append(f"-max_total_time={int(args.seconds) + 60}")
        if args.target != "reader":
            tokens = _envelope_dictionary() if args.target == "envelope" else _event_dictionary()
            dictionary = workdir / f"{args.target}.dict"
            dictionary.write_text("".join(f"{json.dumps(t.decode())}\n" for t in tokens))
            options.append(f"-dict={dictionary}")
    run: Callable[[bytes], None] = target
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    cap = _ADDRESS_SPACE_BYTES if hard == resource.RLIM_INFINITY else min(hard, _ADDRESS_SPACE_BYTES)
    resource.setrlimit(resource.RLIMIT_AS, (cap, hard))
    atheris.Setup([sys.argv[0], *options, *libfuzzer_args, *positional], run)
    atheris.Fuzz()


if __name__ == "__main__":
    main(sys.argv[1:])
