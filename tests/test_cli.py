"""The `fastar` command line: audit end to end, FASTAR_* environment mirrors, one-line errors."""

from __future__ import annotations

import os
import subprocess
import sys

from fastar.cli import build_parser


def _cli(*args, env=None):
    return subprocess.run(
        [sys.executable, "-m", "fastar", *map(str, args)],
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
        timeout=600,
    )


def test_audit_against_transformers(tiny_ckpt, tmp_path):
    out = tmp_path / "t.fst"
    assert _cli("convert", tiny_ckpt, "-o", out).returncode == 0
    r = _cli("audit", out, "--reference", tiny_ckpt, "--tokens", ",".join(str(i) for i in range(3, 60)))
    assert r.returncode == 0, r.stderr
    rows = [
        l.split()
        for l in r.stdout.splitlines()
        if l.startswith(("layer ", "logits ")) and not l.startswith("logits OK")
    ]
    assert [" ".join(x[:2]) for x in rows[:-1]] == [f"layer {i}" for i in range(5)] and rows[-1][0] == "logits"
    assert all(float(x[-3]) > 0.99999 and float(x[-2]) < 1e-4 for x in rows)  # cosine, max |diff|
    assert "logits OK" in r.stdout


def test_env_mirror_and_flag_precedence(monkeypatch):
    monkeypatch.setenv("FASTAR_PORT", "9123")
    a = build_parser().parse_args(["serve", "-m", "x.fst"])
    assert a.port == 9123
    a = build_parser().parse_args(["serve", "-m", "x.fst", "--port", "7000"])
    assert a.port == 7000
    monkeypatch.setenv("FASTAR_MODEL", "from-env.fst")
    a = build_parser().parse_args(["serve"])
    assert a.model == "from-env.fst"


def test_a_misspelt_flag_or_command_is_said_by_its_parser_with_a_guess(capsys):
    """`fastar run --tmp 0` said `fastar: error: unrecognized arguments: --tmp 0 (see fastar --help)`: the top
    parser's words and a help that lists no run flag. The command's parser says it, with the closest flag or
    command (as git and cargo do), and a word close to none gets no guess."""

    for argv, want in (
        (
            ["run", "--tmp", "0", "-p", "x"],
            "fastar run: error: unrecognized arguments: --tmp 0 (did you mean --temp?) (see fastar run --help)",
        ),
        (["serve", "--prot=8080"], "fastar serve: error: unrecognized arguments: --prot=8080 (did you mean --port?)"),
        (["rn", "-p", "x"], "(did you mean run?) (see fastar --help)"),
        (["run", "--xyzzy", "-p", "x"], "fastar run: error: unrecognized arguments: --xyzzy (see fastar run --help)"),
        (["--bogus"], "fastar: error: unrecognized arguments: --bogus (see fastar --help)"),
        (["run", "Hello", "world"], "unrecognized arguments: Hello world (give the prompt with -p, quoted: -p 'TEXT')"),
    ):
        assert_usage_error(capsys, argv, want)


def assert_usage_error(capsys, argv: list[str], want: str) -> None:
    """`fastar ARGV` exits 2 with one line on stderr holding `want`."""
    from fastar.cli import main

    try:
        main(argv)
    except SystemExit as e:
        assert e.code == 2, argv
    else:
        raise AssertionError(f"{argv} was accepted")
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and want in err, (argv, err)


def test_a_misspelt_flag_is_said_before_the_positional_that_took_its_value(capsys):
    """`fastar bench --ram-budgt 1G` said `argument what: invalid choice: '1G'`: argparse gave the misspelt flag's
    value to the positional. The unknown flag is said first, with its guess, as for any misspelt flag; so for
    `convert`, whose misspelt -o left `the following arguments are required: -o/--output`. A positional that is
    wrong by itself is still said as such."""

    for argv, want in (
        (
            ["bench", "--ram-budgt", "1G"],
            "fastar bench: error: unrecognized arguments: --ram-budgt (did you mean --ram-budget?)",
        ),
        (["bench", "-m", "x.fst", "--polices", "lru"], "unrecognized arguments: --polices (did you mean --policies?)"),
        (
            ["convert", "--ouptut", "x.fst", "ckpt"],
            "fastar convert: error: unrecognized arguments: --ouptut (did you mean --output?)",
        ),
        (["convert", "ckpt", "--ouptut", "x.fst"], "unrecognized arguments: --ouptut (did you mean --output?)"),
        (["bench", "--ram-budget", "1G", "modle"], "fastar bench: error: argument what: invalid choice: 'modle'"),
        (["convert", "ckpt"], "the following arguments are required: -o/--output"),
    ):
        assert_usage_error(capsys, argv, want)


def test_a_bad_prefill_share_is_one_usage_line_naming_the_flag(capsys):
    """`fastar serve --prefill-share S`: a number in (0, 1] (the same range flag type as --max-stall and --top-p)."""
    for value in ("0", "1.5", "nan"):
        want = f"argument --prefill-share: --prefill-share must be above 0 and at most 1, got {value}"
        assert_usage_error(capsys, ["serve", "--prefill-share", value], f"fastar serve: error: {want}")
    assert build_parser().parse_args(["serve", "--prefill-share", "1"]).prefill_share == 1.0


def test_a_bad_max_stall_is_one_usage_line_naming_the_flag(capsys, monkeypatch):
    """`fastar serve --max-stall S`: a positive, finite number of seconds; anything else exits 2 with one line naming
    the flag (its FASTAR_MAX_STALL mirror too), before any model loads."""
    for value, want in (
        ("0", "--max-stall must be a finite number above 0, got 0"),
        ("-1", "--max-stall must be a finite number above 0, got -1"),
        ("nan", "--max-stall must be a finite number above 0, got nan"),
        ("inf", "--max-stall must be a finite number above 0, got inf"),
        ("abc", "--max-stall must be a number, got 'abc'"),
    ):
        assert_usage_error(
            capsys, ["serve", "--max-stall", value], f"fastar serve: error: argument --max-stall: {want}"
        )
    assert build_parser().parse_args(["serve", "--max-stall", "0.25"]).max_stall == 0.25
    monkeypatch.setenv("FASTAR_MAX_STALL", "2.5")
    assert build_parser().parse_args(["serve"]).max_stall == 2.5


def test_bench_refuses_what_it_would_time_over_no_decode_call(capsys, monkeypatch, tmp_path):
    """`bench --streams 2 --decode-tokens 1` printed "0.0 tok/s aggregate over 0 calls" (each stream's one token
    comes out of its prefill) and `--decode-tokens 2` timed calls of one row as the rate of 2 streams; `--replay`
    or `--draft` with one token timed the speculative run over none; `--repeats 0`, `--profile 0` and
    `--profile-prefill x` were errors only once the command ran. Each is one usage line naming the flag and the least
    value that works, exit 2, before anything loads (the model named here does not exist)."""
    m = ["bench", "-m", str(tmp_path / "none.fst")]
    for extra, want in (
        (["--streams", "2", "--decode-tokens", "1"], "argument --decode-tokens: at least 3 with --streams 2, got 1"),
        (
            ["--streams", "1,4", "--decode-tokens", "4"],
            "argument --decode-tokens: at least 5 with --streams 1,4, got 4",
        ),
        (["--streams", "1", "--decode-tokens", "1"], "argument --decode-tokens: at least 2 with --streams 1, got 1"),
        (["--replay", "0.5", "--decode-tokens", "1"], "argument --decode-tokens: at least 2 with --replay, got 1"),
        (["--draft", "mtp", "--decode-tokens", "1"], "argument --decode-tokens: at least 2 with --draft mtp, got 1"),
        (["--decode-tokens", "0"], "argument --decode-tokens: --decode-tokens must be at least 1, got 0"),
        (["--prompt-tokens", "0"], "argument --prompt-tokens: --prompt-tokens must be at least 1, got 0"),
        (["--repeats", "0"], "argument --repeats: --repeats must be at least 1, got 0"),
        (["--profile", "0"], "argument --profile: comma-separated row counts 1..8, got '0'"),
        (["--profile", "1,9"], "argument --profile: comma-separated row counts 1..8, got '1,9'"),
        (["--profile", "1", "--decode-tokens", "0"], "argument --decode-tokens"),
        (["--profile-prefill", "x"], "argument --profile-prefill: comma-separated prompt lengths"),
        (["--profile-prefill", "0"], "argument --profile-prefill: comma-separated prompt lengths"),
    ):
        assert_usage_error(capsys, [*m, *extra], f"fastar bench: error: {want}")
    monkeypatch.setenv("FASTAR_DECODE_TOKENS", "2")  # a mirror is checked with the flags
    assert_usage_error(capsys, [*m, "--streams", "2"], "at least 3 with --streams 2, got 2")
    # what does work: --decode-tokens 1 where a decode step is what is timed (the plain model bench, --profile)
    for extra in (["--decode-tokens", "1"], ["--profile", "1,4", "--decode-tokens", "1"], ["--streams", "2"]):
        monkeypatch.setenv("FASTAR_DECODE_TOKENS", "3")
        assert build_parser().parse_args([*m, *extra]).fn is not None


def test_bench_refuses_a_flag_its_benchmark_does_not_read(capsys, monkeypatch, tmp_path):
    """Every bench mode read some flags and took the others silently: `bench draft --decode-tokens 8` decoded 64
    tokens, `bench kernels --streams 4` timed the kernels, `--profile 1 --streams 4` ran the profile alone,
    `--profile 1 --replay 0.5` profiled plain steps. Each flag a mode does not read is one usage line naming the
    flag (and the mode, where the mode is a flag too), exit 2, before anything loads; a flag given with its default
    value counts as given, an environment mirror (a setting) does not."""
    m = ["-m", str(tmp_path / "none.fst")]
    for argv, want in (
        (["bench", "kernels", "--streams", "4"], "argument --streams: bench kernels does not read it"),
        (["bench", "kernels", *m], "argument -m: bench kernels does not read it"),
        (["bench", "kernels", "--cache-policy", "lrfu"], "argument --cache-policy: bench kernels does not read it"),
        (["bench", "draft", *m, "--warmup-tokens", "2"], "argument --warmup-tokens: bench draft does not read it"),
        (["bench", "draft", *m, "--threads", "2"], "argument --threads: bench draft does not read it (it runs on one"),
        (["bench", "draft", *m, "--replay", "0.5"], "argument --replay: bench draft does not read it (it runs replay"),
        (["bench", "draft", *m, "--temp", "1"], "argument --temperature: bench draft does not read it (it decodes"),
        (["bench", "draft", *m, "--no-verify"], "argument --no-verify: bench draft does not read it"),
        (["bench", "draft", *m, "--decode-tokens", "1"], "argument --decode-tokens: at least 2 with bench draft"),
        (["bench", *m, "--profile", "1", "--streams", "4"], "argument --streams: not with --profile (one benchmark"),
        (["bench", *m, "--profile-prefill", "8", "--profile", "1"], "argument --profile-prefill: not with --profile"),
        (["bench", *m, "--streams", "2", "--profile-prefill", "8"], "argument --streams: not with --profile-prefill"),
        (["bench", *m, "--profile", "1", "--replay", "0.5"], "argument --replay: not with --profile (the decode-step"),
        (["bench", *m, "--profile", "1", "--repeats", "2"], "argument --repeats: not with --profile"),
        (["bench", *m, "--profile", "1", "--compare", "x.fst"], "argument --compare: not with --profile"),
        (["bench", *m, "--profile-prefill", "8", "--decode-tokens", "3"], "argument --decode-tokens: not with --pro"),
        (["bench", *m, "--streams", "2", "--compare-transformers", "d"], "argument --compare-transformers: not with"),
        (
            ["bench", *m, "--streams", "2", "--temperature", "0.5"],
            "argument --temperature: not with --streams (the streams",
        ),
        (["bench", *m, "--streams", "2", "--device", "cuda"], "argument --device: not with --streams"),
        (["bench", *m, "--streams", "2", "--draft", "mtp"], "argument --draft: not with --streams"),
        (["bench", *m, "--profile", "1", "--plot", "p.png"], "argument --plot: not with --profile"),
        (["bench", *m, "--force"], "argument --force: it replaces an existing --plot file"),
        (["bench", *m, "--profile", "1", "--ram-budget", "1G,2G"], "argument --ram-budget: one budget with --profile"),
        (["bench", *m, "--streams", "2", "--ram-budget", "1G,2G"], "argument --ram-budget: one budget with --streams"),
    ):
        assert_usage_error(capsys, argv, f"fastar bench: error: {want}")
    monkeypatch.setenv("FASTAR_CACHE_POLICY", "lru")  # a setting of every command that loads a model
    monkeypatch.setenv("FASTAR_WARMUP_TOKENS", "4")
    for argv in (
        ["bench", "kernels", "--threads", "1,2", "--json"],
        ["bench", "draft", *m, "--decode-tokens", "8", "--prompt-tokens", "4", "--repeats", "2", "--ram-budget", "1G"],
        ["bench", "draft", *m, "--draft", "mtp", "--no-head-screen", "--json"],
        ["bench", *m, "--profile", "1,4", "--decode-tokens", "4", "--prompt-tokens", "8", "--no-verify", "--lookahead"],
        ["bench", *m, "--profile-prefill", "64", "--repeats", "2", "--ram-budget", "none", "--threads", "2"],
        ["bench", *m, "--streams", "1,4", "--decode-tokens", "5", "--prompt-tokens", "8", "--cache-policy", "lru"],
        ["bench", *m, "--replay", "0.8", "--compare", "x.fst", "--plot", "p.png", "--force", "--repeats", "2"],
    ):
        assert build_parser().parse_args(argv).fn is not None, argv


def test_bench_draft_reads_its_counts(monkeypatch, tiny_fst_path):
    """`bench draft` decoded 64 tokens after 24-token prompts, 3 times, whatever --decode-tokens, --prompt-tokens and
    --repeats said; now they set them, and without them it keeps its own counts (not the model bench's 16, 64, 1)."""
    from fastar import bench
    from fastar.bench import speculative

    seen = []
    monkeypatch.setattr(speculative, "bench", lambda path, **kw: seen.append(kw) or [])
    m = ["bench", "draft", "-m", str(tiny_fst_path)]
    for extra in (["--decode-tokens", "8", "--prompt-tokens", "5", "--repeats", "2"], []):
        a = build_parser().parse_args([*m, *extra, "--json"])
        assert bench.main(a) == 0
    assert [(k["tokens"], k["prompt_tokens"], k["reps"]) for k in seen] == [(8, 5, 2), (64, 24, 3)]


def test_env_mirror_of_a_switch_reads_a_boolean(monkeypatch, capsys):
    """A switch's mirror is a boolean, also for the on/off pairs whose default is None (auto): FASTAR_DIRECT_IO=0
    turns O_DIRECT off (it was the string "0", a true value, so it forced O_DIRECT on), and a word that is no
    boolean is a usage error naming the variable instead of a silent False."""
    from fastar.cli import main

    for value, want in (("0", False), ("off", False), ("", False), ("1", True), ("Yes", True)):
        monkeypatch.setenv("FASTAR_DIRECT_IO", value)
        monkeypatch.setenv("FASTAR_PROGRESS", value)
        monkeypatch.setenv("FASTAR_VERBOSE", value)
        a = build_parser().parse_args(["run", "-p", "x"])
        assert (a.direct_io, a.verbose) == (want, want), value
        assert build_parser().parse_args(["convert", "a", "-o", "b"]).progress is want, value
    assert build_parser().parse_args(["run", "-p", "x", "--no-direct-io"]).direct_io is False  # the flag wins
    monkeypatch.delenv("FASTAR_PROGRESS")
    monkeypatch.delenv("FASTAR_DIRECT_IO")
    monkeypatch.setenv("FASTAR_VERBOSE", "maybe")
    assert main(["run", "-p", "x"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("fastar: error: FASTAR_VERBOSE='maybe': expected 1/true"), err


def test_serve_refuses_an_empty_host_or_model_name(monkeypatch, capsys):
    """`--host ""` (or FASTAR_HOST="", an unset variable in a service file) bound every interface, as 0.0.0.0,
    instead of this machine only; an empty --served-model-name named the model "". Both are usage errors."""
    from fastar.cli import main

    for argv, env, words in (
        (["--host", ""], {}, "--host is empty"),
        (["--host", " "], {}, "--host is empty"),
        ([], {"FASTAR_HOST": ""}, "FASTAR_HOST=''"),
        (["--served-model-name", ""], {}, "--served-model-name is empty"),
    ):
        with monkeypatch.context() as mp:
            for k, v in env.items():
                mp.setenv(k, v)
            try:
                code = main(["serve", "-m", "x.fst", *argv])
            except SystemExit as e:
                code = e.code
        err = capsys.readouterr().err
        assert code == 2 and err.count("\n") == 1 and words in err, (argv, env, code, err)
    assert build_parser().parse_args(["serve", "--host", "0.0.0.0"]).host == "0.0.0.0"


def test_env_mirror_of_a_flag_with_choices_is_checked_as_the_flag_is(monkeypatch, capsys):
    """FASTAR_REASONING_DEFAULT=bogus (or FASTAR_NUMERICS, FASTAR_DRAFT) is the usage error `--reasoning-default
    bogus` is: it went past argparse's choices and ended in a ValueError traceback, or ran with the value ignored."""
    from fastar.cli import main

    for name in ("REASONING_DEFAULT", "NUMERICS", "DRAFT"):
        with monkeypatch.context() as mp:
            mp.setenv(f"FASTAR_{name}", "bogus")
            assert main(["serve", "-m", "x.fst"]) == 2
            err = capsys.readouterr().err
            assert err.count("\n") == 1, (name, err)
            assert err.startswith("fastar: error: ") and f"FASTAR_{name}='bogus'" in err and "choose from" in err, err
    monkeypatch.setenv("FASTAR_REASONING_DEFAULT", "none")  # a valid value is the flag's default
    assert build_parser().parse_args(["serve"]).reasoning_default == "none"


def test_errors_are_one_line(tmp_path):
    bad = tmp_path / "notes.txt"
    bad.write_text("hello")
    for args in (["verify", bad], ["inspect", tmp_path / "missing.fst"], ["verify", tmp_path]):
        r = _cli(*args)
        assert r.returncode == 1
        assert "Traceback" not in r.stderr and r.stderr.count("\n") == 1 and r.stderr.startswith("fastar: error:")


def test_serve_passes_draft_to_the_engine(tiny_ckpt, monkeypatch, capsys):
    """`serve --draft mtp` loads the drafter (the scheduler drafts a lone greedy request); the default is none."""
    from fastar import cli

    seen = {}
    a = build_parser().parse_args(["serve", "-m", str(tiny_ckpt), "--draft", "mtp", "--max-batch", "3"])
    monkeypatch.setattr(a.serve_mod, "run_from_args", lambda args, factory: seen.update(vars(args)) or 0)
    assert cli.cmd_serve(a) == 0
    assert capsys.readouterr().err == ""
    assert seen["draft"] == "mtp" and seen["max_batch"] == 3
    assert build_parser().parse_args(["serve", "-m", str(tiny_ckpt)]).draft == "none"


def test_serve_loads_warm(vocab_ckpt, tmp_path, monkeypatch):
    """`serve`'s engine starts its expert warm-up with the load, following the usage profile kept beside the prompt
    cache (saved there at close), and its tokenizer's tables are built before the server reports ready."""
    from fastar import cli
    from fastar.engine.source import open_source
    from fastar.engine.tokenizer import Tokenizer

    stride = open_source(vocab_ckpt).expert_stride
    argv = ["serve", "-m", str(vocab_ckpt), "--ram-budget", str(stride * 6), "--prompt-cache", str(tmp_path)]
    a = build_parser().parse_args(argv)
    factories = []
    monkeypatch.setattr(a.serve_mod, "run_from_args", lambda args, factory: factories.append(factory) or 0)
    assert cli.cmd_serve(a) == 0
    engine = factories[0]()
    try:
        assert engine.warm_status()["status"] in ("loading", "ready")
        ids = engine.tokenizer.encode("hello world")

        def built_again(self):
            raise AssertionError("the token bytes table was built on the first reply")

        monkeypatch.setattr(Tokenizer, "_build_token_bytes", built_again)
        assert b"".join(engine.tokenizer.token_bytes(i) for i in ids) == b"hello world"
    finally:
        engine.close()
    assert len(list(tmp_path.glob("hot-experts-*.json"))) == 1


def test_every_option_says_what_it_does():
    """`fastar COMMAND --help` explains every option and argument: `serve --numerics`, `run --top-p`, `synth
    --layers`, `fixture --preset` and others were listed without a word (a user could not tell what
    `reference` numerics are, or that the default fixture runs no text)."""
    import argparse

    parser = build_parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
    silent = [
        f"{name} {action.option_strings[-1] if action.option_strings else action.dest}"
        for name, sub in commands.items()
        for action in sub._actions
        if not isinstance(action, argparse._HelpAction) and not (action.help or "").strip()
    ]
    assert len(commands) >= 12 and silent == []
    assert "FASTAR_<FLAG> environment variable" in parser.format_help()  # the mirrors are said where flags are


def test_generation_options_state_their_defaults(monkeypatch):
    """`run --help` and `chat --help` say what an option does when left out, as llama.cpp's help does: -n was
    "most tokens to generate per reply" with no word of run's 256 or chat's 1024, and --temp, --seed, --thinking
    and --cache-policy were as silent. A FASTAR_* mirror changes the default, and the help says so."""
    import argparse

    def helps(command: str) -> dict[str, str]:
        commands = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)).choices
        sub = commands[command]
        return {o: sub._get_formatter()._expand_help(a) for a in sub._actions for o in a.option_strings}

    for command, n in (("run", 256), ("chat", 1024)):
        h = helps(command)
        assert h["-n"].endswith(f"(default {n})"), h["-n"]
        assert h["--temp"].endswith("(default 0.0)")
        assert "default: a new one each run" in h["--seed"]
        assert "default: off" in h["--thinking"]
        assert "lrfu (default" in h["--cache-policy"]
    monkeypatch.setenv("FASTAR_MAX_TOKENS", "64")
    assert helps("run")["-n"].endswith("(default 64)")
