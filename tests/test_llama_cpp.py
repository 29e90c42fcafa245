"""llama.cpp as a benchmark peer, without llama.cpp: fake binaries print what the real ones print (captured from
llama-completion and llama-lookup built by ../shared/peers/build_llama_cpp.sh, SmolLM2-135M-Instruct F32, 2 threads)."""

# ruff: noqa: E501, W291 (llama.cpp's lines below are pasted as it prints them)
from __future__ import annotations

import json
import logging
import os
import struct
import sys
from pathlib import Path

import pytest

from medusa import llama_cpp

PROMPT = (
    "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
    "<|im_start|>user\nWrite a short poem about the sea.<|im_end|>\n<|im_start|>assistant\n"
)
POEM = (
    "The waves of the ocean, a tapestry woven with life,\n"
    "A canvas of endless blue, a canvas of endless blue,\n"
    "A realm where the unknown lies, a realm where the unknown lies,\n"
    "A world where the sea is a place, a place where the sea is a place,\n"
    "A world where the"
)

# llama-completion -n 64 on PROMPT: its whole stderr
COMPLETION_STDERR = """\
0.00.006.693 I llama_completion: llama backend init
0.00.007.662 I llama_completion: load the model and apply lora adapter, if any
0.00.333.912 I cmn          init: llama threadpool init, n_threads = 2
0.00.627.216 I generate: n_ctx = 8192, n_batch = 2048, n_predict = 64, n_keep = 0
0.00.627.216 I 
0.08.970.047 I common_perf_print:    sampling time =       3.13 ms
0.08.970.064 I common_perf_print:    samplers time =       1.14 ms /   102 tokens
0.08.970.077 I common_perf_print:        load time =     474.88 ms
0.08.970.089 I common_perf_print: prompt eval time =     692.10 ms /    38 tokens (   18.21 ms per token,    54.91 tokens per second)
0.08.970.100 I common_perf_print:        eval time =    7433.03 ms /    63 runs   (  117.98 ms per token,     8.48 tokens per second)
0.08.970.111 I common_perf_print:       total time =    8343.22 ms /   101 tokens
0.08.970.123 I common_perf_print: unaccounted time =     214.96 ms /   2.6 %      (total - sampling - prompt eval - eval) / (total)
0.08.970.133 I common_perf_print:    graphs reused =         62
"""

# the same with a prompt the model answers in 12 tokens, end of turn included
COMPLETION_EOS_STDERR = """\
0.03.224.834 I common_perf_print:    sampling time =       6.17 ms
0.03.224.852 I common_perf_print:    samplers time =       0.24 ms /    50 tokens
0.03.224.864 I common_perf_print:        load time =     951.59 ms
0.03.224.876 I common_perf_print: prompt eval time =     383.41 ms /    38 tokens (   10.09 ms per token,    99.11 tokens per second)
0.03.224.888 I common_perf_print:        eval time =    1609.19 ms /    11 runs   (  146.29 ms per token,     6.84 tokens per second)
0.03.224.899 I common_perf_print:       total time =    2004.58 ms /    49 tokens
"""

# -n 1: no single-token eval ran, yet llama.cpp prints "1 runs"
COMPLETION_ONE_TOKEN_STDERR = """\
0.04.533.153 I common_perf_print:    sampling time =       0.27 ms
0.04.533.155 I common_perf_print:    samplers time =       0.02 ms /    39 tokens
0.04.533.157 I common_perf_print:        load time =    3851.78 ms
0.04.533.158 I common_perf_print: prompt eval time =     497.15 ms /    38 tokens (   13.08 ms per token,    76.44 tokens per second)
0.04.533.159 I common_perf_print:        eval time =       0.00 ms /     1 runs   (    0.00 ms per token,      inf tokens per second)
0.04.533.159 I common_perf_print:       total time =     497.86 ms /    39 tokens
"""

# llama-lookup -n 63 on PROMPT
LOOKUP_STDERR = """\
0.01.108.228 I cmn          init: llama threadpool init, n_threads = 2
0.24.653.212 I encoded   38 tokens in   10.036 seconds, speed:   10.363 t/s
0.24.653.222 I decoded   66 tokens in    7.788 seconds, speed:    8.475 t/s
0.24.653.222 I 
0.24.653.223 I n_draft      = 3
0.24.653.223 I n_predict    = 66
0.24.653.223 I n_drafted    = 31
0.24.653.224 I t_draft_flat = 12.08 ms
0.24.653.225 I t_draft      = 0.49 ms, 15.84 us per token, 63136.46 tokens per second
0.24.653.225 I n_accept     = 15
0.24.653.226 I accept       = 48.387%
0.24.653.226 I 
target:

0.24.653.227 I common_perf_print:    sampling time =       3.26 ms
0.24.653.237 I common_perf_print:    samplers time =       1.13 ms /    66 tokens
0.24.653.237 I common_perf_print:        load time =    6552.32 ms
0.24.653.239 I common_perf_print: prompt eval time =   12124.05 ms /    80 tokens (  151.55 ms per token,     6.60 tokens per second)
0.24.653.239 I common_perf_print:        eval time =    5443.03 ms /    39 runs   (  139.56 ms per token,     7.17 tokens per second)
0.24.653.240 I common_perf_print:       total time =   17836.28 ms /   119 tokens
0.24.653.240 I common_perf_print: unaccounted time =     265.93 ms /   1.5 %      (total - sampling - prompt eval - eval) / (total)
0.24.653.240 I common_perf_print:    graphs reused =         37
"""

# One script stands in for every binary; it acts by the name it is called as and does what fake.json says.
FAKE_BINARY = """\
import json, os, signal, sys
from pathlib import Path

here = Path(__file__).parent
name = Path(sys.argv[0]).name
spec = json.loads((here / "fake.json").read_text())
with open(here / "calls.jsonl", "a") as log:
    env = sorted(k for k in os.environ if k.startswith("LLAMA_"))
    log.write(json.dumps({"argv": sys.argv[1:], "name": name, "env": env}) + "\\n")
sys.stderr.write(spec.get("stderr", ""))
if spec.get("crash_unless_no_repack") and "--no-repack" not in sys.argv:
    os.kill(os.getpid(), signal.SIGSEGV)
if name == "llama-quantize":
    dst, file_type = sys.argv[-2], sys.argv[-1]
    Path(dst).write_text(spec.get("written", "weights as ") + file_type)
elif name == "llama-lookup":
    prompt = sys.argv[sys.argv.index("-p") + 1]
    sys.stdout.write("\\n\\n" + prompt + spec["text"] + "\\n\\n\\n\\n")
else:
    sys.stdout.write(spec["text"] + "\\n\\n")
sys.exit(spec.get("exit_code", 0))
"""


class FakeLlamaCpp:
    def __init__(self, bin_dir: Path):
        self.bin_dir = bin_dir

    def behave(self, **spec) -> None:
        (self.bin_dir / "fake.json").write_text(json.dumps(spec))

    def calls(self) -> list[dict]:
        log = self.bin_dir / "calls.jsonl"
        return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


@pytest.fixture
def fake(tmp_path, monkeypatch) -> FakeLlamaCpp:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for binary in llama_cpp.BINARIES.values():
        path = bin_dir / binary
        path.write_text(f"#!{sys.executable}\n" + FAKE_BINARY)
        path.chmod(0o755)
    monkeypatch.setenv("LLAMA_CPP_BIN", str(bin_dir))
    monkeypatch.setenv("MEDUSA_CACHE", str(tmp_path / "cache"))
    fake = FakeLlamaCpp(bin_dir)
    fake.behave(text="", stderr="")
    return fake


def write_gguf(path: Path, file_type: int | None, tokens: dict[str, int] | None = None) -> Path:
    """A GGUF header without tensors: string and array entries first, so a reader must skip them correctly.
    `tokens`: text -> llama.cpp token type (3: control)."""

    def string(text: str) -> bytes:
        data = text.encode()
        return struct.pack("<Q", len(data)) + data

    tokens = tokens or {"<|endoftext|>": 3, "hello": 1}
    entries = [
        string("general.architecture") + struct.pack("<I", 8) + string("llama"),
        string("llama.block_count") + struct.pack("<II", 4, 30),
        string("tokenizer.ggml.tokens")
        + struct.pack("<IIQ", 9, 8, len(tokens))
        + b"".join(string(text) for text in tokens),
        string("tokenizer.ggml.token_type")
        + struct.pack("<IIQ", 9, 5, len(tokens))
        + b"".join(struct.pack("<i", kind) for kind in tokens.values()),
    ]
    if file_type is not None:
        entries.append(string("general.file_type") + struct.pack("<II", 4, file_type))
    path.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, len(entries)) + b"".join(entries))
    return path


# ------------------------------------------------------------------ parsing llama.cpp's own lines
def test_parse_timings_reads_llama_completions_lines():
    timings = llama_cpp.parse_timings(COMPLETION_STDERR)
    assert timings == {
        "sampling_ms": 3.13,
        "samplers_ms": 1.14,
        "sampled_tokens": 102,
        "load_ms": 474.88,
        "prompt_eval_ms": 692.10,
        "prompt_eval_tokens": 38,
        "eval_ms": 7433.03,
        "eval_runs": 63,
        "total_ms": 8343.22,
        "total_tokens": 101,
    }


def test_parse_timings_reads_llama_lookups_lines():
    timings = llama_cpp.parse_timings(LOOKUP_STDERR)
    assert timings["encoded_tokens"] == 38 and timings["encode_s"] == 10.036
    assert timings["decoded_tokens"] == 66 and timings["decode_s"] == 7.788
    assert (timings["n_draft"], timings["n_predict"], timings["n_drafted"], timings["n_accept"]) == (3, 66, 31, 15)
    assert timings["prompt_eval_tokens"] == 80 and timings["eval_runs"] == 39  # its target context, drafts included


def test_parse_timings_finds_nothing_in_other_text():
    assert llama_cpp.parse_timings("error: failed to load model\nmain: exiting\n") == {}


# ------------------------------------------------------------------ generating through the fake binaries
def test_plain_generation_passes_the_prompt_verbatim_and_times_prefill_plus_decode(fake, tmp_path, monkeypatch):
    gguf = write_gguf(tmp_path / "m.gguf", 0)
    fake.behave(text=POEM, stderr=COMPLETION_STDERR)
    monkeypatch.setenv("LLAMA_ARG_N_PREDICT", "5")  # a user's setting must not change what the benchmark runs
    prompt = PROMPT + 'a literal \\n, a "quote" and a tab\t'
    run = llama_cpp.generate(gguf, prompt, max_new_tokens=64, threads=2, method="plain")

    (call,) = fake.calls()
    argv = call["argv"]
    assert call["name"] == "llama-completion"
    assert argv[argv.index("-p") + 1] == prompt
    assert argv[argv.index("-m") + 1] == str(gguf)
    assert argv[argv.index("-n") + 1] == "64" and argv[argv.index("-t") + 1] == "2"
    assert argv[argv.index("--temp") + 1] == "0" and argv[argv.index("--top-k") + 1] == "1"
    assert {"--no-escape", "-no-cnv", "--no-display-prompt"} <= set(argv)
    assert "tokenizer.ggml.add_bos_token=bool:false" in argv[argv.index("--override-kv") + 1]
    assert not [k for k in call["env"] if k.startswith("LLAMA_ARG_")]

    assert run.text == POEM
    assert (run.n_new_tokens, run.n_prompt_tokens, run.stopped_at_eos) == (64, 38, False)
    assert run.prefill_ms == 692.10
    assert run.decode_ms == pytest.approx(7433.03 + 3.13)
    assert run.seconds == pytest.approx((692.10 + 7433.03 + 3.13) / 1000)
    assert run.tokens_per_second == pytest.approx(64 / run.seconds)
    assert run.n_drafted is None and run.n_accepted is None


def test_plain_generation_that_ends_its_turn(fake, tmp_path):
    fake.behave(text="I'm ready to help. What's the question? [end of text]\n", stderr=COMPLETION_EOS_STDERR)
    run = llama_cpp.generate(write_gguf(tmp_path / "m.gguf", 0), PROMPT, 64, 2)
    assert run.text == "I'm ready to help. What's the question?"
    assert run.stopped_at_eos and run.n_new_tokens == 12


def test_one_new_token_is_counted_as_one(fake, tmp_path):
    fake.behave(text="I", stderr=COMPLETION_ONE_TOKEN_STDERR)
    run = llama_cpp.generate(write_gguf(tmp_path / "m.gguf", 0), PROMPT, 1, 2)
    assert (run.text, run.n_new_tokens, run.prefill_ms) == ("I", 1, 497.15)


def test_lookup_generation_cuts_out_the_echoed_prompt_and_counts_drafts(fake, tmp_path):
    gguf = write_gguf(tmp_path / "m.gguf", 0)
    fake.behave(text=POEM + " sea is", stderr=LOOKUP_STDERR)
    run = llama_cpp.generate(gguf, PROMPT, max_new_tokens=64, threads=2, method="lookup", draft_max=5)

    (call,) = fake.calls()
    argv = call["argv"]
    assert call["name"] == "llama-lookup"
    assert argv[argv.index("-n") + 1] == "63"  # it samples one more than -n
    assert argv[argv.index("--spec-draft-n-max") + 1] == "5"
    assert argv[argv.index("-p") + 1] == PROMPT and "--no-escape" in argv

    assert run.text == POEM + " sea is"
    assert (run.n_new_tokens, run.n_prompt_tokens, run.n_drafted, run.n_accepted) == (66, 38, 31, 15)
    assert run.prefill_ms == pytest.approx(10036) and run.decode_ms == pytest.approx(7788)
    assert not run.stopped_at_eos


def test_lookup_generation_leaves_out_the_end_of_turn_token_it_prints(fake, tmp_path):
    gguf = write_gguf(tmp_path / "m.gguf", 0, tokens={"<|endoftext|>": 3, "<|im_end|>": 3, "end": 1})
    stderr = LOOKUP_STDERR.replace("decoded   66 tokens", "decoded   12 tokens")
    fake.behave(text="I'm ready to help.<|im_end|>", stderr=stderr)
    run = llama_cpp.generate(gguf, PROMPT, 64, 2, method="lookup")
    assert run.text == "I'm ready to help."
    assert run.stopped_at_eos and run.n_new_tokens == 12


def test_a_failing_binary_raises_naming_the_command_and_its_stderr(fake, tmp_path):
    stderr = "".join(f"line {i}\n" for i in range(40)) + "llama_model_load: error loading model: bad magic\n"
    fake.behave(text="", stderr=stderr, exit_code=1)
    with pytest.raises(llama_cpp.LlamaCppError) as caught:
        llama_cpp.generate(write_gguf(tmp_path / "m.gguf", 0), PROMPT, 8, 2)
    message = str(caught.value)
    assert "llama-completion" in message and "exit status 1" in message
    assert "error loading model: bad magic" in message
    assert "line 39" in message and "line 0\n" not in message  # the tail, not all of it


def test_a_crash_with_repacked_weights_runs_again_without_them_and_says_so(fake, tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(llama_cpp, "WITHOUT_REPACKING", set())
    gguf = write_gguf(tmp_path / "m.gguf", 7)
    fake.behave(text=POEM, stderr=COMPLETION_STDERR, crash_unless_no_repack=True)
    with caplog.at_level(logging.WARNING, logger="medusa.llama_cpp"):
        first = llama_cpp.generate(gguf, PROMPT, 64, 2)
    second = llama_cpp.generate(gguf, PROMPT, 64, 2)
    assert first.text == second.text == POEM
    assert ["--no-repack" in call["argv"] for call in fake.calls()] == [False, True, True]  # one crash, then not
    assert "llama-completion died by signal 11 on m.gguf" in caplog.text
    assert llama_cpp.build_info()["without_repacking"] == ["m.gguf"]
    fake.behave(text="", stderr="still broken\n", exit_code=1)  # a failure that is no crash is not retried
    with pytest.raises(llama_cpp.LlamaCppError, match="exit status 1"):
        llama_cpp.generate(write_gguf(tmp_path / "other.gguf", 7), PROMPT, 8, 2)
    assert "--no-repack" not in fake.calls()[-1]["argv"]


def test_output_without_timing_lines_is_refused_clearly(fake, tmp_path):
    fake.behave(text="hello", stderr="nothing to see\n")
    with pytest.raises(llama_cpp.LlamaCppError, match="no timing line for prompt_eval_ms"):
        llama_cpp.generate(write_gguf(tmp_path / "m.gguf", 0), PROMPT, 8, 2)


def test_bad_arguments_are_refused_before_running(fake, tmp_path):
    gguf = write_gguf(tmp_path / "m.gguf", 0)
    with pytest.raises(ValueError, match="unknown method"):
        llama_cpp.generate(gguf, PROMPT, 8, 2, method="speculative")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        llama_cpp.generate(tmp_path / "absent.gguf", PROMPT, 8, 2)
    assert fake.calls() == []


# ------------------------------------------------------------------ finding the binaries
def test_missing_binaries_are_named_with_the_fix(tmp_path, monkeypatch):
    monkeypatch.setenv("LLAMA_CPP_BIN", str(tmp_path / "nowhere"))
    reason = llama_cpp.missing_reason()
    assert reason is not None and "\n" not in reason
    assert str(tmp_path / "nowhere" / "llama-completion") in reason
    assert "build_llama_cpp.sh" in reason and "LLAMA_CPP_BIN" in reason
    with pytest.raises(FileNotFoundError, match="llama-lookup is missing"):
        llama_cpp.generate(write_gguf(tmp_path / "m.gguf", 0), PROMPT, 8, 2, method="lookup")


def test_binaries_present_means_no_reason(fake):
    assert llama_cpp.binaries_dir() == fake.bin_dir
    assert llama_cpp.missing_reason() is None
    (fake.bin_dir / "llama-lookup").unlink()
    assert llama_cpp.missing_reason(("plain",)) is None
    assert "llama-lookup" in llama_cpp.missing_reason()


def test_default_binaries_dir_is_what_the_build_script_writes(monkeypatch):
    monkeypatch.delenv("LLAMA_CPP_BIN", raising=False)
    assert llama_cpp.binaries_dir() == Path.home() / ".cache" / "medusa-peers" / "llama.cpp" / "bin"


# ------------------------------------------------------------------ GGUF files per precision
def test_gguf_type_is_read_after_skipping_arrays(tmp_path):
    assert llama_cpp.gguf_type(write_gguf(tmp_path / "a.gguf", 3)) == "Q4_1"
    assert llama_cpp.gguf_type(write_gguf(tmp_path / "b.gguf", 7)) == "Q8_0"
    assert llama_cpp.gguf_type(write_gguf(tmp_path / "c.gguf", None)) is None
    (tmp_path / "d.gguf").write_bytes(b"not a gguf file")
    with pytest.raises(ValueError, match="not a GGUF file"):
        llama_cpp.gguf_type(tmp_path / "d.gguf")


def test_gguf_for_quantizes_once_and_reuses_the_file(fake, tmp_path):
    source = write_gguf(tmp_path / "SmolLM2.Q4_1.gguf", 3)
    out = llama_cpp.gguf_for(source, "float32")
    assert out == tmp_path / "cache" / "peers" / "SmolLM2.Q4_1-F32.gguf"
    assert out.read_text() == "weights as F32"
    (call,) = fake.calls()
    assert call["name"] == "llama-quantize"
    assert call["argv"][:2] == ["--allow-requantize", str(source)] and call["argv"][3] == "F32"
    written_to = Path(call["argv"][2])
    assert written_to != out and written_to.parent == out.parent  # a temporary name, renamed into place
    assert not written_to.exists()

    assert llama_cpp.gguf_for(source, "float32") == out
    assert len(fake.calls()) == 1
    assert llama_cpp.gguf_for(source, "int8").read_text() == "weights as Q8_0"
    assert len(fake.calls()) == 2
    os.utime(source, (out.stat().st_mtime + 10, out.stat().st_mtime + 10))  # the source was replaced since
    assert llama_cpp.gguf_for(source, "float32") == out
    assert len(fake.calls()) == 3
    assert sorted(p.name for p in out.parent.iterdir() if not p.name.endswith(".lock")) == [
        "SmolLM2.Q4_1-F32.gguf",
        "SmolLM2.Q4_1-Q8_0.gguf",
    ]


def test_a_failed_quantize_leaves_no_file_behind(fake, tmp_path):
    source = write_gguf(tmp_path / "m.gguf", 3)
    fake.behave(written="half a file", stderr="llama_model_quantize: failed to quantize\n", exit_code=1)
    with pytest.raises(llama_cpp.LlamaCppError, match="(?s)llama-quantize --allow-requantize .*failed to quantize"):
        llama_cpp.gguf_for(source, "bfloat16")
    peers = tmp_path / "cache" / "peers"
    assert [p.name for p in peers.iterdir() if not p.name.endswith(".lock")] == []
    fake.behave(stderr="")
    assert llama_cpp.gguf_for(source, "bfloat16").read_text() == "weights as BF16"  # the next try starts afresh


def test_a_source_already_of_the_type_is_used_as_is(fake, tmp_path):
    source = write_gguf(tmp_path / "m.Q4_1.gguf", 3)
    assert llama_cpp.gguf_for(source, "int4") == source
    assert fake.calls() == []
    with pytest.raises(ValueError, match="unknown precision"):
        llama_cpp.gguf_for(source, "float16")


def test_every_precision_has_a_gguf_type():
    from medusa.precision import PRECISIONS

    assert set(llama_cpp.PRECISIONS) == set(PRECISIONS) - {"float16", "auto"}  # every precision a benchmark names
    assert llama_cpp.PRECISIONS["int8"] == llama_cpp.PRECISIONS["w8a8"] == "Q8_0"  # Q8_0 rounds activations too
    assert set(llama_cpp.PRECISIONS.values()) <= set(llama_cpp._FILE_TYPES.values())
