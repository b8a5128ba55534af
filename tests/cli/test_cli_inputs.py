"""Bad flags and input files: exit status 2 and one line naming them, before any model loads."""
import pytest

import spd.model.loading as loading
from spd.cli import main


@pytest.fixture(autouse=True)
def no_model_load(monkeypatch):
    """Every refusal here must come before the (seconds-long) model load."""
    def load(*a, **k):
        raise AssertionError("the model was loaded before the input was checked")
    monkeypatch.setattr(loading, "load_target", load)


def _err(capsys) -> str:
    err = capsys.readouterr().err.strip()
    return err.splitlines()[-1]  # argparse prints its usage line first


GEN = ["generate", "--prompt", "hi"]


@pytest.mark.parametrize("argv,msg", [
    (GEN + ["--pdm-layers", "-2"], "argument --pdm-layers: must be an integer >= 1, got -2"),
    (GEN + ["--pdm-layers", "0"], "argument --pdm-layers: must be an integer >= 1, got 0"),
    (GEN + ["--seed", str(2**70)], "argument --seed: must be an integer in [0, 2**63 - 1]"
     .replace("2**63 - 1", str(2**63 - 1))),
    (GEN + ["--seed", "-1"], "argument --seed: must be an integer in"),
    (GEN + ["--lookup", str(10**9)], "argument --lookup: must be an integer in [0, 6], got"),
    (GEN + ["--lookup", "-1"], "argument --lookup: must be an integer in [0, 6], got -1"),
    (GEN + ["--device", "banana"], "argument --device: must be cpu, cuda or cuda:N, got 'banana'"),
    (GEN + ["--device", "meta"], "argument --device: must be cpu, cuda or cuda:N, got 'meta'"),
    (["train", "--out", "x", "--pdm-layers", "0"], "argument --pdm-layers: must be an integer >= 1"),
    (["train", "--out", "x", "--seed", str(2**70)], "argument --seed: must be an integer in"),
    (["train", "--out", "x", "--device", "meta"], "argument --device: must be cpu, cuda or"),
    (["eval", "--device", "banana"], "argument --device: must be cpu, cuda or cuda:N"),
    (["eval", "--seed", str(2**70)], "argument --seed: must be an integer in"),
    (["eval", "--lookup", str(10**9)], "argument --lookup: must be an integer in [0, 6]"),
    (GEN + ["--dtype", "int8"], "argument --dtype: must be one of auto, float32, bfloat16"),
    (["eval", "--dtype", "float64"], "argument --dtype: must be one of auto, float32"),
])
def test_flag_ranges(capsys, argv, msg):
    assert main(argv) == 2
    assert msg in _err(capsys)


@pytest.mark.parametrize("prompt,msg", [
    ("", "the prompt is empty: pass --prompt TEXT"),
    # the argv bytes b"caf\xe9" arrive on Linux as:
    ("caf\udce9", "--prompt is not valid UTF-8 text: pass it in the UTF-8 encoding"),
])
def test_bad_prompts_are_refused_before_loading(capsys, prompt, msg):
    assert main(["generate", "--prompt", prompt]) == 2
    assert _err(capsys) == f"spd: error: {msg}"


def test_too_small_a_temperature_is_refused_before_loading(capsys):
    assert main(GEN + ["--temperature", "1e-30"]) == 2
    assert "too small to sample with" in _err(capsys)


def test_a_prompts_folder_is_refused(tmp_path, capsys):
    assert main(["eval", "--prompts", str(tmp_path)]) == 2
    assert _err(capsys) == f"spd: error: prompt file {tmp_path} is a folder, not a .jsonl file"


def test_a_prompts_file_that_is_not_utf8_is_refused(tmp_path, capsys):
    f = tmp_path / "q.jsonl"
    f.write_bytes(b'{"turns": ["caf\xe9"]}\n')
    assert main(["eval", "--prompts", str(f)]) == 2
    assert f"prompt file {f} is not UTF-8 text (byte 15: b'\\xe9')" in _err(capsys)


def test_json_out_below_a_file_is_refused_before_decoding(tmp_path, capsys):
    prompts = tmp_path / "q.jsonl"
    prompts.write_text('{"turns": ["hi"]}\n')
    (tmp_path / "afile").write_text("")
    out = tmp_path / "afile" / "report.json"
    assert main(["eval", "--prompts", str(prompts), "--json-out", str(out)]) == 2
    assert _err(capsys) == (f"spd: error: --json-out {out} cannot be written: "
                            f"{tmp_path / 'afile'} is a file, not a folder")
    assert main(["eval", "--prompts", str(prompts), "--json-out", str(tmp_path)]) == 2
    assert "is a folder; give a file name" in _err(capsys)


def test_eval_grid_refuses_zero_pdm_layers(capsys):
    assert main(["eval", "--methods", "spd", "--dataset", "mt_bench", "--limit", "1",
                 "--pdm-layers", "2,0"]) == 2
    assert "--pdm-layers takes PDM depths >= 1, got '2,0'" in _err(capsys)


def test_the_api_refuses_bad_seeds_and_lookups(tiny_target):
    from spd import SPDEngine
    from spd.errors import SPDError
    from spd.runtime.types import SamplingParams
    with pytest.raises(SPDError, match="seed must be an integer in"):
        SamplingParams(seed=2**70)
    with pytest.raises(SPDError, match="too small"):
        SamplingParams(temperature=1e-30)
    with pytest.raises(SPDError, match=r"lookup is a match length in \[0, 6\]"):
        SPDEngine(tiny_target, n_stages=2, lookup=10**9, warn_untrained=False)


def test_dtype_flag_takes_the_short_forms():
    from spd.cli.main import build_parser
    for given, name in (("bf16", "bfloat16"), ("FP32", "float32"), ("half", "float16"),
                        ("auto", "auto")):
        assert build_parser().parse_args(GEN + ["--dtype", given]).dtype == name


def test_prompt_file_stdin_system_threads_quiet_parse_and_refuse(tmp_path, capsys, monkeypatch):
    """--prompt-file (a file or '-' for stdin) stands in for --prompt, never both; a missing,
    empty or non-UTF-8 file is one line before any model loads; --threads >= 1."""
    import io

    from spd.cli.generate import read_prompt
    from spd.cli.main import build_parser
    good = tmp_path / "p.txt"
    good.write_text("Explain caches.\nIn detail.", encoding="utf-8")
    parse = build_parser().parse_args
    args = parse(["generate", "--prompt-file", str(good), "--system", "Be brief.",
                  "--threads", "1", "--quiet"])
    assert read_prompt(args) == "Explain caches.\nIn detail."
    assert (args.system, args.threads, args.quiet) == ("Be brief.", 1, True)
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO("from stdin".encode())))
    assert read_prompt(parse(["generate", "--prompt-file", "-"])) == "from stdin"
    (tmp_path / "empty.txt").write_text("  \n")
    (tmp_path / "latin1.txt").write_bytes(b"caf\xe9")
    for name, msg in (("missing.txt", "No such file"), ("empty.txt", "the prompt is empty"),
                      ("latin1.txt", "not UTF-8 text")):
        assert main(["generate", "--prompt-file", str(tmp_path / name)]) == 2
        assert msg in _err(capsys)
    assert main(["generate", "--prompt", "a", "--prompt-file", str(good)]) == 2
    assert "not allowed with argument" in _err(capsys)
    assert main(["generate", "--prompt", "a", "--threads", "0"]) == 2
    assert "argument --threads: must be an integer >= 1" in _err(capsys)


@pytest.mark.parametrize("error,status,line", [
    (lambda: __import__("spd.errors").errors.SPDError("the model folder has no config.json"),
     2, "spd: error: the model folder has no config.json"),
    (lambda: __import__("spd.errors").errors.InternalError("KV cache overflow", rows=9,
                                                           capacity=8),
     1, "spd: internal error: KV cache overflow (rows=9, capacity=8). This is a bug in spd"),
])
def test_input_errors_exit_2_and_internal_faults_exit_1(capsys, monkeypatch, error, status,
                                                         line):
    """Whose fault it is decides the status: the caller's input 2, the runtime's own fault 1,
    and its message says it is a bug, not a usage error."""
    def load(*a, **k):
        raise error()
    monkeypatch.setattr(loading, "load_target", load)
    assert main(GEN) == status
    assert _err(capsys).startswith(line)
