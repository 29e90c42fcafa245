"""llama.cpp as a peer in our benchmark: the same weights, prompts and settings run through its own binaries, so our
figures stand next to what a CPU user who wants speed would run instead. Never a dependency: the binaries are found
at `$LLAMA_CPP_BIN` (built by `../shared/peers/build_llama_cpp.sh`) and their absence is reported, not raised.
"""

from __future__ import annotations

import logging
import os
import re
import shlex
import struct
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO, Literal

from medusa.fileio import atomic_file, one_at_a_time
from medusa.loading import cache_root

BUILD_SCRIPT = "bash ../shared/peers/build_llama_cpp.sh"
BINARIES = {"plain": "llama-completion", "lookup": "llama-lookup", "quantize": "llama-quantize"}

# Our precision names -> the GGUF type llama.cpp runs at that precision (Q4_1: the shipped file's own type). Q8_0 rounds
# activations to 8 bits too (per block of 32), so it stands beside both int8 and w8a8.
PRECISIONS = {"float32": "F32", "bfloat16": "BF16", "int8": "Q8_0", "w8a8": "Q8_0", "int4": "Q4_1"}

# llama.h's llama_ftype values for the types above, as written in a GGUF file's `general.file_type`.
_FILE_TYPES = {0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 7: "Q8_0", 32: "BF16"}

Method = Literal["plain", "lookup"]

logger = logging.getLogger(__name__)

# GGUF files whose run died by a signal with llama.cpp's repacked weights (its extra CPU buffers: AMX and repacked
# layouts; Q8_0 prompts died with SIGSEGV on a Xeon with AMX), run with --no-repack from then on in this process
WITHOUT_REPACKING: set[str] = set()


class LlamaCppError(RuntimeError):
    """A llama.cpp binary failed or printed what this module cannot read."""


class LlamaCppCrash(LlamaCppError):
    """A llama.cpp binary died by a signal."""

    def __init__(self, message: str, signal: int):
        super().__init__(message)
        self.signal = signal


def binaries_dir() -> Path:
    """`$LLAMA_CPP_BIN`, else where build_llama_cpp.sh puts the binaries."""
    default = Path.home() / ".cache" / "medusa-peers" / "llama.cpp" / "bin"
    return Path(os.environ.get("LLAMA_CPP_BIN", default)).expanduser()


def build_info() -> dict:
    """Which llama.cpp a benchmark ran: its binaries' folder and the line build_llama_cpp.sh writes beside them
    (`BUILD_INFO`: the version and the CPU flags it was built for; None for a build made otherwise) and the GGUF
    files that ran with --no-repack after a crash."""
    folder = binaries_dir()
    info = folder.parent / "BUILD_INFO"
    return {
        "bin": str(folder),
        "build": info.read_text().strip() if info.is_file() else None,
        "without_repacking": sorted(Path(f).name for f in WITHOUT_REPACKING),
    }


def missing_reason(methods: tuple[str, ...] = ("plain", "lookup", "quantize")) -> str | None:
    """None when the binaries `methods` need are present; else one line naming the first missing one and the fix,
    for a benchmark to print when it skips the peer."""
    for method in methods:
        binary = binaries_dir() / BINARIES[method]
        if not (binary.is_file() and os.access(binary, os.X_OK)):
            return (
                f"llama.cpp binary {binary} is missing: build it with `{BUILD_SCRIPT}` "
                "or set LLAMA_CPP_BIN to a folder holding llama.cpp's binaries"
            )
    return None


def _binary(method: str) -> Path:
    reason = missing_reason((method,))
    if reason:
        raise FileNotFoundError(reason)
    return binaries_dir() / BINARIES[method]


# ------------------------------------------------------------------ GGUF files per precision
def gguf_type(path: Path) -> str | None:
    """The GGUF type a file was written as (`general.file_type`: "F32", "Q4_1", ...), None if unknown or unset."""
    file_type = _gguf_metadata(Path(path), {"general.file_type"}).get("general.file_type")
    return _FILE_TYPES.get(file_type) if isinstance(file_type, int) else None


def _control_token_texts(path: Path) -> list[str]:
    """Texts of the vocabulary's control tokens (end of turn, end of text, ...), longest first."""
    meta = _gguf_metadata(path, {"tokenizer.ggml.tokens", "tokenizer.ggml.token_type"})
    tokens, types = meta.get("tokenizer.ggml.tokens", []), meta.get("tokenizer.ggml.token_type", [])
    return sorted({text for text, kind in zip(tokens, types) if kind == _CONTROL_TOKEN and text}, key=len, reverse=True)


_CONTROL_TOKEN = 3  # llama_token_type LLAMA_TOKEN_TYPE_CONTROL
# GGUF value types with a fixed size -> struct format; 8 is a string, 9 an array.
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9


def _gguf_metadata(path: Path, wanted: set[str]) -> dict:
    """The `wanted` keys of a GGUF file's header (arrays as lists), read with the standard library only; the read
    stops once all are found, so the tensors are never touched."""
    found: dict = {}
    with open(path, "rb") as handle:
        if handle.read(4) != b"GGUF":
            raise ValueError(f"{path} is not a GGUF file")
        version, _tensors, kv_count = struct.unpack("<IQQ", handle.read(20))
        if version < 2:  # version 1 counted with 32-bit integers; llama.cpp no longer reads it either
            return found
        for _ in range(kv_count):
            if wanted <= found.keys():
                break
            key = _read_value(handle, _STRING, keep=True)
            (value_type,) = struct.unpack("<I", handle.read(4))
            value = _read_value(handle, value_type, keep=key in wanted)
            if key in wanted:
                found[key] = value
    return found


def _read_value(handle: BinaryIO, value_type: int, keep: bool):
    """Read one value (`keep`), or skip over it (not `keep`: returns None)."""
    if value_type in _SCALARS:
        size = struct.calcsize(_SCALARS[value_type])
        if not keep:
            handle.seek(size, os.SEEK_CUR)
            return None
        return struct.unpack("<" + _SCALARS[value_type], handle.read(size))[0]
    if value_type == _STRING:
        (length,) = struct.unpack("<Q", handle.read(8))
        if not keep:
            handle.seek(length, os.SEEK_CUR)
            return None
        return handle.read(length).decode("utf-8", errors="replace")
    if value_type == _ARRAY:
        item_type, count = struct.unpack("<IQ", handle.read(12))
        if not keep and item_type in _SCALARS:
            handle.seek(count * struct.calcsize(_SCALARS[item_type]), os.SEEK_CUR)
            return None
        items = [_read_value(handle, item_type, keep) for _ in range(count)]
        return items if keep else None
    raise ValueError(f"unknown GGUF value type {value_type}")


def gguf_for(source_gguf: Path, precision: str) -> Path:
    """The source's weights as a GGUF file of `precision`'s type, made once with llama-quantize and reused after
    (made again when the source is newer than it: a file of the same name may have been replaced).

        `--allow-requantize` lets a quantised source (the shipped Q4_1) be written as F32/BF16/Q8_0, so the F32 file
        holds exactly the weights medusa dequantises from it. The file is written under a temporary name and renamed,
        one process at a time, so a killed or concurrent run never leaves a half file where the next run looks.
    """
    if precision not in PRECISIONS:
        raise ValueError(f"unknown precision {precision!r}: use one of {sorted(PRECISIONS)}")
    source_gguf = Path(source_gguf)
    if not source_gguf.is_file():
        raise FileNotFoundError(f"GGUF file {source_gguf} does not exist")
    target_type = PRECISIONS[precision]
    if gguf_type(source_gguf) == target_type:
        return source_gguf
    out = cache_root() / "peers" / f"{source_gguf.stem}-{target_type}.gguf"
    made = lambda: out.is_file() and out.stat().st_mtime >= source_gguf.stat().st_mtime
    if made():
        return out
    quantize = _binary("quantize")
    with one_at_a_time(out.parent / f".{out.name}.lock", f"writing {out.name} with llama-quantize"):
        if not made():  # another process may have written it while this one waited
            with atomic_file(out, suffix=".gguf") as tmp:
                _run([str(quantize), "--allow-requantize", str(source_gguf), str(tmp), target_type])
    return out


# ------------------------------------------------------------------ generation
@dataclass
class PeerRun:
    """One greedy generation by llama.cpp, timed by its own counters: prefill included, model load excluded."""

    method: str
    gguf: Path
    text: str  # the new text only, special tokens left out (as our bench decodes with skip_special_tokens)
    n_new_tokens: int
    n_prompt_tokens: int
    prefill_ms: float
    decode_ms: float
    stopped_at_eos: bool
    n_drafted: int | None = None  # lookup: tokens the n-gram cache proposed
    n_accepted: int | None = None  # lookup: of those, tokens the model kept
    timings: dict = field(default_factory=dict, repr=False)  # everything parse_timings found

    @property
    def seconds(self) -> float:
        return (self.prefill_ms + self.decode_ms) / 1000

    @property
    def tokens_per_second(self) -> float:
        return self.n_new_tokens / self.seconds if self.seconds > 0 else float("nan")


_NUMBER = r"([0-9]+(?:\.[0-9]+)?)"
_LINE_START = r"(?m)^(?:[0-9.]+ [A-Z] )?"  # a line's start, after the time and level llama.cpp's log may print
_TIMING_LINES = {
    # common_perf_print / llama_perf_context_print (llama-completion, and the target context of llama-lookup)
    ("load_ms",): rf"load time\s*=\s*{_NUMBER} ms",
    ("prompt_eval_ms", "prompt_eval_tokens"): rf"prompt eval time\s*=\s*{_NUMBER} ms\s*/\s*(\d+) tokens",
    ("eval_ms", "eval_runs"): rf"(?<!prompt )eval time\s*=\s*{_NUMBER} ms\s*/\s*(\d+) runs",
    ("sampling_ms",): rf"(?<!\w)sampling time\s*=\s*{_NUMBER} ms",
    ("samplers_ms", "sampled_tokens"): rf"samplers time\s*=\s*{_NUMBER} ms\s*/\s*(\d+) (?:tokens|runs)",
    ("total_ms", "total_tokens"): rf"total time\s*=\s*{_NUMBER} ms\s*/\s*(\d+) tokens",
    # llama-lookup's own wall clock around prefill and the decode loop (drafting and sampling included)
    ("encoded_tokens", "encode_s"): rf"{_LINE_START}encoded\s+(\d+) tokens in\s+{_NUMBER} seconds",
    ("decoded_tokens", "decode_s"): rf"{_LINE_START}decoded\s+(\d+) tokens in\s+{_NUMBER} seconds",
    # its counters; at a line's start, as "n_predict = " also appears inside llama-completion's settings line
    ("n_draft",): rf"{_LINE_START}n_draft\s*=\s*(\d+)",
    ("n_predict",): rf"{_LINE_START}n_predict\s*=\s*(\d+)",
    ("n_drafted",): rf"{_LINE_START}n_drafted\s*=\s*(\d+)",
    ("n_accept",): rf"{_LINE_START}n_accept\s*=\s*(\d+)",
}


def parse_timings(stderr_text: str) -> dict:
    """The timing and counting lines llama.cpp prints on stderr -> {name: number}, only the ones present.

    Times keep llama.cpp's units in their names (`*_ms`, `*_s`); counts are ints. When a line appears twice, the
    last one counts (the final report comes last).
    """
    found: dict[str, float | int] = {}
    for names, pattern in _TIMING_LINES.items():
        matches = re.findall(pattern, stderr_text)
        if not matches:
            continue
        values = matches[-1] if isinstance(matches[-1], tuple) else (matches[-1],)
        for name, value in zip(names, values):
            found[name] = float(value) if name.endswith(("_ms", "_s")) else int(value)
    return found


def generate(
    gguf: Path,
    prompt: str,
    max_new_tokens: int,
    threads: int,
    method: Method = "plain",
    *,
    draft_max: int | None = None,
    timeout: float | None = None,
) -> PeerRun:
    """Greedy-decode `prompt` (already chat-templated text, passed through byte for byte) with llama-completion
    ("plain") or llama-lookup ("lookup": n-gram drafts from the prompt and the output, `draft_max` tokens at most,
    llama.cpp's default when None).

    llama-lookup stops at the first verify step that reaches `max_new_tokens`, so it may return a few more.
    """
    if method not in ("plain", "lookup"):
        raise ValueError(f"unknown method {method!r}: use 'plain' or 'lookup'")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
    gguf = Path(gguf)
    if not gguf.is_file():
        raise FileNotFoundError(f"GGUF file {gguf} does not exist")
    command = [str(_binary(method)), "-m", str(gguf), *_shared_flags(prompt, threads)]
    if method == "plain":
        command += ["-n", str(max_new_tokens), "-no-cnv", "--no-display-prompt", "--simple-io"]
    else:
        # llama-lookup stops once it has sampled more than -n tokens, and never for -n 0
        command += ["-n", str(max(max_new_tokens - 1, 1))]
        if draft_max is not None:
            command += ["--spec-draft-n-max", str(draft_max)]
    result = _run_repacked_or_not(command, gguf, timeout)
    timings = parse_timings(result.stderr)
    if method == "plain":
        return _plain_run(gguf, result.stdout, timings, command, result.stderr)
    return _lookup_run(gguf, prompt, max_new_tokens, result.stdout, timings, command, result.stderr)


def _shared_flags(prompt: str, threads: int) -> list[str]:
    """Flags both binaries take: greedy, the prompt exactly as given, no colour."""
    return [
        "-p",
        prompt,
        "--no-escape",  # llama.cpp turns "\n" written as two characters into a newline by default
        # the prompt is already templated: it carries a BOS if the template has one, llama.cpp adds none
        "--override-kv",
        "tokenizer.ggml.add_bos_token=bool:false,tokenizer.ggml.add_eos_token=bool:false",
        "--temp",
        "0",
        "--top-k",
        "1",
        "-t",
        str(threads),
        "-tb",
        str(threads),
        "--color",
        "off",
    ]


def _plain_run(gguf: Path, stdout: str, timings: dict, command: list[str], stderr: str) -> PeerRun:
    """llama-completion: stdout is the new text (special tokens print as nothing), then "[end of text]" at EOS."""
    _require(timings, ("prompt_eval_ms", "prompt_eval_tokens", "eval_ms", "sampled_tokens"), command, stderr)
    # the sampler counts the prompt's tokens too; "eval runs" cannot say 0 (it prints at least 1)
    n_new = timings["sampled_tokens"] - timings["prompt_eval_tokens"]
    text = stdout.removesuffix("\n\n")
    stopped = text.endswith(" [end of text]\n")
    text = text.removesuffix(" [end of text]\n")
    return PeerRun(
        method="plain",
        gguf=gguf,
        text=text,
        n_new_tokens=n_new,
        n_prompt_tokens=timings["prompt_eval_tokens"],
        prefill_ms=timings["prompt_eval_ms"],
        # sampling counts as decoding, as it does in our own timed loop; eval_ms alone is the forward passes
        decode_ms=timings["eval_ms"] + timings.get("sampling_ms", 0.0),
        stopped_at_eos=stopped,
        timings=timings,
    )


def _lookup_run(
    gguf: Path, prompt: str, max_new_tokens: int, stdout: str, timings: dict, command: list[str], stderr: str
) -> PeerRun:
    """llama-lookup: stdout echoes the prompt token by token, then the new tokens with special ones spelled out.

    Its own encode/decode clocks are used: its context counters file every multi-token draft verify as prompt eval.
    """
    _require(timings, ("encoded_tokens", "encode_s", "decoded_tokens", "decode_s"), command, stderr)
    text = stdout.removeprefix("\n\n").removesuffix("\n\n\n\n")
    if not text.startswith(prompt):
        raise LlamaCppError(
            f"{Path(command[0]).name} did not echo the prompt as given, so its new text cannot be cut out; "
            f"stdout begins {stdout[:200]!r}"
        )
    text = text[len(prompt) :]
    n_new = timings["decoded_tokens"]
    # llama-lookup spells out the end-of-turn token it stopped at; our bench leaves special tokens out
    last_control = next((piece for piece in _control_token_texts(gguf) if text.endswith(piece)), None)
    if last_control is not None:
        text = text.removesuffix(last_control)
    stopped = last_control is not None or n_new < max_new_tokens
    return PeerRun(
        method="lookup",
        gguf=gguf,
        text=text,
        n_new_tokens=n_new,
        n_prompt_tokens=timings["encoded_tokens"],
        prefill_ms=timings["encode_s"] * 1000,
        decode_ms=timings["decode_s"] * 1000,
        stopped_at_eos=stopped,
        n_drafted=timings.get("n_drafted"),
        n_accepted=timings.get("n_accept"),
        timings=timings,
    )


def _require(timings: dict, names: tuple[str, ...], command: list[str], stderr: str) -> None:
    missing = [name for name in names if name not in timings]
    if missing:
        raise LlamaCppError(
            f"{Path(command[0]).name} printed no timing line for {', '.join(missing)} "
            f"(has this llama.cpp version changed them?); its stderr ended with:\n{_tail(stderr)}"
        )


def _run_repacked_or_not(command: list[str], gguf: Path, timeout: float | None) -> subprocess.CompletedProcess:
    """_run; where llama.cpp dies by a signal with its repacked weights, again with --no-repack (a warning says so,
    build_info records it), and so on for that file: the peer runs as a user of this CPU would get it to run."""
    if str(gguf) not in WITHOUT_REPACKING:
        try:
            return _run(command, timeout=timeout)
        except LlamaCppCrash as err:
            logger.warning(
                "%s died by signal %d on %s with llama.cpp's repacked weights; running that file with --no-repack "
                "from now on",
                Path(command[0]).name,
                err.signal,
                gguf.name,
            )
            WITHOUT_REPACKING.add(str(gguf))
    return _run([*command, "--no-repack"], timeout=timeout)


def _run(command: list[str], timeout: float | None = None) -> subprocess.CompletedProcess:
    """Run a llama.cpp binary; a failure names the command and shows the end of its stderr."""
    # LLAMA_ARG_* variables would change the flags behind our back, LLAMA_LOG_* the lines parse_timings reads
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LLAMA_ARG_", "LLAMA_LOG_"))}
    try:
        result = subprocess.run(
            command,
            capture_output=True,
            encoding="utf-8",
            errors="replace",
            env=env,
            timeout=timeout,
            stdin=subprocess.DEVNULL,
        )
    except subprocess.TimeoutExpired as err:
        stderr = err.stderr.decode(errors="replace") if isinstance(err.stderr, bytes) else err.stderr or ""
        raise LlamaCppError(f"{_shown(command)} ran past {timeout} s; its stderr ended with:\n{_tail(stderr)}") from err
    if result.returncode != 0:
        message = f"{_shown(command)} failed with exit status {result.returncode}; its stderr ended with:\n"
        message += _tail(result.stderr)
        raise LlamaCppCrash(message, -result.returncode) if result.returncode < 0 else LlamaCppError(message)
    return result


def _shown(command: list[str]) -> str:
    """The command as a shell line, a long prompt cut short."""
    shown = [
        arg[:60] + "..." if previous == "-p" and len(arg) > 80 else arg
        for previous, arg in zip([""] + command, command)
    ]
    return shlex.join(shown)


def _tail(text: str, lines: int = 15) -> str:
    return "\n".join(text.rstrip().splitlines()[-lines:]) or "(empty)"
