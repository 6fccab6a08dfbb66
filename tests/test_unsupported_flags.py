"""vLLM's flags and env vars that pagedllm does not take: known, refused with the next step
or warned about with the reason, never argparse's "unrecognized arguments"; every problem
of a command in one message (exit 2); errors spelled for their reader (flags on the
command line, keyword arguments in Python); `--config FILE.yaml`."""

from __future__ import annotations

import logging
from types import SimpleNamespace
from typing import Any

import pytest

from pagedllm import cli
from pagedllm.core import envs
from pagedllm.core.config import ConfigError, EngineConfig, spell
from pagedllm.core.vllm_args import REFUSE, VLLM_ONLY_ARGS, WARN
from pagedllm.engine_args import engine_config_from_args, parse_token_count

# `vllm serve --help` (v0.10-v0.11 docs, "vllm serve" and "Engine Arguments"), less -h.
VLLM_SERVE_FLAGS = """
--headless --api-server-count -asc --config --disable-log-stats --enable-log-requests --disable-log-requests
--host --port --uds --uvicorn-log-level --disable-uvicorn-access-log --allow-credentials --allowed-origins
--allowed-methods --allowed-headers --api-key --lora-modules --chat-template --chat-template-content-format
--trust-request-chat-template --response-role --ssl-keyfile --ssl-certfile --ssl-ca-certs --enable-ssl-refresh
--ssl-cert-reqs --root-path --middleware --return-tokens-as-token-ids --disable-frontend-multiprocessing
--enable-request-id-headers --enable-auto-tool-choice --exclude-tools-when-tool-choice-none --tool-call-parser
--tool-parser-plugin --tool-server --log-config-file --max-log-len --disable-fastapi-docs
--enable-prompt-tokens-details --enable-server-load-tracking --enable-force-include-usage
--enable-tokenizer-info-endpoint --enable-log-outputs --h11-max-incomplete-event-size --h11-max-header-count
--log-error-stack --model --runner --convert --task --tokenizer --tokenizer-mode --trust-remote-code --dtype --seed
--hf-config-path --allowed-local-media-path --allowed-media-domains --revision --code-revision --rope-scaling
--rope-theta --tokenizer-revision --max-model-len --quantization -q --enforce-eager --max-logprobs --logprobs-mode
--disable-sliding-window --disable-cascade-attn --skip-tokenizer-init --enable-prompt-embeds --served-model-name
--config-format --hf-token --hf-overrides --pooler-config --override-pooler-config --logits-processor-pattern
--generation-config --override-generation-config --enable-sleep-mode --model-impl --override-attention-dtype
--logits-processors --io-processor-plugin --load-format --download-dir --safetensors-load-strategy
--model-loader-extra-config --ignore-patterns --use-tqdm-on-load --pt-load-map-location --reasoning-parser
--guided-decoding-backend --distributed-executor-backend --pipeline-parallel-size -pp --tensor-parallel-size -tp
--decode-context-parallel-size -dcp --data-parallel-size -dp --data-parallel-rank --data-parallel-start-rank
--data-parallel-size-local -dpl --data-parallel-address -dpa --data-parallel-rpc-port -dpp --data-parallel-backend
-dpb --data-parallel-hybrid-lb --data-parallel-external-lb --enable-expert-parallel -ep --enable-dbo
--dbo-decode-token-threshold --dbo-prefill-token-threshold --disable-nccl-for-dp-synchronization --enable-eplb
--eplb-config --expert-placement-strategy --num-redundant-experts --eplb-window-size --eplb-step-interval
--eplb-log-balancedness --max-parallel-loading-workers --ray-workers-use-nsight --disable-custom-all-reduce
--worker-cls --worker-extension-cls --nnodes --node-rank --master-addr --master-port --all2all-backend
--block-size --gpu-memory-utilization --kv-cache-memory-bytes --swap-space --kv-cache-dtype
--num-gpu-blocks-override --enable-prefix-caching --prefix-caching-hash-algo --cpu-offload-gb
--calculate-kv-scales --kv-sharing-fast-prefill --mamba-cache-dtype --mamba-ssm-cache-dtype
--kv-offloading-size --kv-offloading-backend --limit-mm-per-prompt --media-io-kwargs --mm-processor-kwargs
--mm-processor-cache-gb --mm-processor-cache-type --mm-shm-cache-max-object-size-mb --mm-encoder-tp-mode
--interleave-mm-strings --skip-mm-profiling --video-pruning-rate --enable-lora --enable-lora-bias --max-loras
--max-lora-rank --lora-extra-vocab-size --lora-dtype --max-cpu-loras --fully-sharded-loras --default-mm-loras
--show-hidden-metrics-for-version --otlp-traces-endpoint --collect-detailed-traces --max-num-batched-tokens
--max-num-seqs --max-num-partial-prefills --max-long-partial-prefills --cuda-graph-sizes
--long-prefill-token-threshold --num-lookahead-slots --scheduling-policy --enable-chunked-prefill
--disable-chunked-mm-input --scheduler-cls --disable-hybrid-kv-cache-manager --async-scheduling
--speculative-config --kv-transfer-config --kv-events-config --compilation-config -O --additional-config
--structured-outputs-config --shutdown-timeout --aggregate-engine-logging --grpc --fail-on-environ-validation
""".split()


def serve_parser() -> Any:
    return cli.build_parser(["serve"])._subparsers._group_actions[0].choices["serve"]


def parse(*argv: str) -> Any:
    return cli.build_parser(list(argv)).parse_args(list(argv))


def test_every_vllm_serve_flag_is_known() -> None:
    known = set(serve_parser()._option_string_actions)
    missing = [flag for flag in VLLM_SERVE_FLAGS if flag not in known]
    assert not missing, f"flags vLLM users type that `pagedllm serve` would call unrecognized: {missing}"


def test_the_table_says_why_for_every_row() -> None:
    for name, arg in VLLM_ONLY_ARGS.items():
        assert arg.verdict in (REFUSE, WARN) and arg.scope in ("engine", "server"), name
        assert len(arg.reason) > 20, name
        assert arg.kind in (str, bool, list), name
    assert "enable_lora" in VLLM_ONLY_ARGS and "swap_space" in VLLM_ONLY_ARGS


def value_for(name: str) -> list[str]:
    arg = VLLM_ONLY_ARGS[name]
    return [] if arg.kind is bool else ["7"]


@pytest.mark.parametrize("name", sorted(n for n, a in VLLM_ONLY_ARGS.items() if a.verdict == REFUSE))
def test_a_refused_flag_exits_2_saying_not_supported(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    flag = "--" + name.replace("_", "-")
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["serve", "/no/model", flag, *value_for(name)])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert f"error: {flag}" in err and "not supported" in err and "unrecognized" not in err, err
    assert "Traceback" not in err


@pytest.mark.parametrize("name", sorted(n for n, a in VLLM_ONLY_ARGS.items() if a.verdict == WARN))
def test_a_flag_that_changes_nothing_warns_why(name: str, caplog: pytest.LogCaptureFixture) -> None:
    flag = "--" + name.replace("_", "-")
    with caplog.at_level(logging.INFO, logger="pagedllm"):
        cli.serve_setup(parse("serve", "/no/model", flag, *value_for(name)))
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith(flag)]
    assert said and ("has no effect here: " in said[0] or "what pagedllm does anyway" in said[0]), said


def test_values_that_ask_for_what_pagedllm_does_are_accepted(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="pagedllm"):
        cli.serve_setup(parse("serve", "/m", "--task", "generate", "--no-enable-lora", "--max-logprobs", "20",
                              "--preemption-mode", "recompute", "--response-role", "assistant"))
    notes = [r.getMessage() for r in caplog.records if "what pagedllm does anyway" in r.getMessage()]
    assert len(notes) == 5, notes


def test_one_attempt_reports_every_problem(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
                                           caplog: pytest.LogCaptureFixture) -> None:
    """Today's three-attempt command (a parser refusal, a config one, a plugin one) and more, in one message."""
    monkeypatch.setenv("VLLM_ATTENTION_BACKEND", "DUAL_CHUNK_FLASH_ATTN")
    monkeypatch.setenv("VLLM_FUSED_MOE_CHUNK_SIZE", "lots")
    with caplog.at_level(logging.WARNING, logger="pagedllm"), pytest.raises(SystemExit) as exit_info:
        cli.main(["serve", "/no/model", "--enable-lora", "--max-num-seqs", "0", "-q", "nope", "--swap-space", "4",
                  "--speculative-config", '{"method": "nope", "num_speculative_tokens": 2}', "--ssl-keyfile", "k",
                  "--tool-call-parser", "nope"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "8 problems in this configuration" in err, err
    for expected in ["--enable-lora: LoRA adapters are not supported yet", "max_num_seqs must be >= 1",
                     "--quantization nope: unknown quantization 'nope'", "unknown speculative method 'nope'",
                     "--ssl-keyfile k: TLS is not supported yet", "unknown --tool-call-parser 'nope'",
                     ("VLLM_ATTENTION_BACKEND=DUAL_CHUNK_FLASH_ATTN: unknown attention backend; unset "
                      "VLLM_ATTENTION_BACKEND (the fastest that can run here is then chosen) or set it to one of"),
                     "VLLM_FUSED_MOE_CHUNK_SIZE='lots': expected a positive integer; unset VLLM_FUSED_MOE_CHUNK_SIZE"]:
        assert expected in err, expected
    assert any("--swap-space 4 has no effect here" in r.getMessage() for r in caplog.records)


def test_python_errors_speak_python_and_cli_errors_speak_flags() -> None:
    kwargs = {"nnodes": 2, "tensor_parallel_size": 2, "enable_lora": True, "speculative_config": {}}
    with pytest.raises(ConfigError) as python_error:
        EngineConfig.from_kwargs(**kwargs)
    text = str(python_error.value)
    assert "nnodes > 1 needs master_port" in text and "enable_lora=True: LoRA" in text
    assert "speculative_config is empty" in text and "--" not in text.replace("\n  - ", "\n"), text
    assert "nnodes > 1 needs --master-port" in python_error.value.message("cli")
    assert "--enable-lora: LoRA" in python_error.value.message("cli")
    assert spell("give {node_rank=R} or {enable_x=False}", "cli") == "give --node-rank R or --no-enable-x"
    assert spell('{speculative_config={"method": "ngram"}}', "cli") == "--speculative-config '{\"method\": \"ngram\"}'"
    assert spell('{x={"a": 1}} {"json": 1}') == 'x={"a": 1} {"json": 1}'


def test_an_unknown_keyword_is_a_type_error_with_a_suggestion() -> None:
    with pytest.raises(TypeError, match="unexpected engine argument 'max_modle_len' \\(did you mean max_model_len"):
        EngineConfig.from_kwargs(max_modle_len=3, max_num_seqs=0)
    with pytest.raises(ValueError, match="max_num_seqs must be >= 1"):
        EngineConfig.from_kwargs(max_modle_len=3, max_num_seqs=0)


def test_a_typo_flag_is_named_under_the_subcommand(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["serve", "--max-num-seqz", "4"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "pagedllm serve: error: unrecognized arguments: --max-num-seqz (did you mean --max-num-seqs" in err


def test_vllm_spellings_of_sizes_and_names() -> None:
    assert [parse_token_count(t) for t in ("32768", "32k", "32K", "1M")] == [32768, 32000, 32768, 1 << 20]
    config = engine_config_from_args(parse("serve", "--max-model-len", "4K", "--kv-cache-memory-bytes", "1G"))
    assert config.model.max_model_len == 4096 and config.cache.kv_cache_memory == 1 << 30
    assert EngineConfig.from_kwargs(kv_cache_memory_bytes=123).cache.kv_cache_memory == 123
    assert parse("serve", "-asc", "2").api_server_count == 2


def test_unknown_quantization_lists_what_is_installed_and_how_to_get_one() -> None:
    with pytest.raises(ConfigError) as err:
        engine_config_from_args(parse("serve", "/m", "--quantization", "int3"))
    text = err.value.message("cli")
    assert text.startswith("--quantization int3: unknown quantization 'int3'; available here: ")
    for part in ("fp8", "gguf", "gptq (also gptq_marlin)", "serve the .gguf file", "pagedllm_quant_methods"):
        assert part in text, part


def test_environment_values_are_checked_naming_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [*envs.VALUE_CHECKS, *(v.alias for v in envs.ENV_VARS.values() if v.alias)]:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "-1")
    monkeypatch.setenv("VLLM_PORT", "http")
    monkeypatch.setenv("PAGEDLLM_CPU_OMP_THREADS_BIND", "0-3|4-7")
    problems = envs.check_values()
    assert len(problems) == 2, problems
    assert problems[0].startswith("VLLM_CPU_KVCACHE_SPACE='-1': expected a positive number; unset")
    assert problems[1].startswith("VLLM_PORT='http': expected a port number")
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE")
    monkeypatch.delenv("VLLM_PORT")
    monkeypatch.setenv("VLLM_ATTENTION_BACKEND", "TRITON_ATTN")  # vLLM's name: accepted
    assert engine_config_from_args(parse("serve", "/m", "--kv-cache-memory", "1G")) is not None
    monkeypatch.setenv("VLLM_ATTENTION_BACKEND", "NOPE")
    engine_config_from_args(parse("serve", "/m", "--attention-backend", "TORCH"))  # the flag wins


def write(tmp_path: Any, text: str) -> str:
    path = tmp_path / "config.yaml"
    path.write_text(text)
    return str(path)


def test_config_file_flags_apply_and_the_command_line_overrides(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    seen: dict[str, Any] = {}
    monkeypatch.setattr(cli, "serve", lambda args, parser: seen.update(vars(args)))
    path = write(tmp_path, "model: /from/file\nmax-model-len: 2048\nmax_num_seqs: 8\nenable_prefix_caching: false\n"
                           "port: 9000\nspeculative-config: {method: ngram, num_speculative_tokens: 3}\n")
    cli.main(["serve", "--config", path, "--max-num-seqs", "4"])
    assert seen["model"] == "/from/file" and seen["max_model_len"] == 2048 and seen["max_num_seqs"] == 4
    assert seen["enable_prefix_caching"] is False and seen["port"] == 9000
    assert seen["speculative_config"] == {"method": "ngram", "num_speculative_tokens": 3}
    seen.clear()
    cli.main(["serve", "/from/cli", "--config", path])
    assert seen["model_tag"] == "/from/cli" and "model" not in seen, "the command line's model wins"


@pytest.mark.parametrize("text,message", [
    ("max-model-len: 2048\nmax_modle_len: 3\nsrever: x\n", ("unknown key(s) max_modle_len, srever: not flags of "
                                                           "`pagedllm serve`")),
    ("- a\n- b\n", "expected a mapping of flag names to values, got list"),
    ("a: [\n", "cannot be read as YAML"),
])
def test_a_bad_config_file_exits_2_naming_it(tmp_path: Any, capsys: pytest.CaptureFixture[str], text: str,
                                             message: str) -> None:
    path = write(tmp_path, text)
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["serve", "--config", path])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert f"--config {path}: " in err and message in err, err


def test_refused_flags_in_a_config_file_are_refused_too(tmp_path: Any, capsys: pytest.CaptureFixture[str]) -> None:
    path = write(tmp_path, "enable-lora: true\nswap_space: 4\n")
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["serve", "/no/model", "--config", path])
    assert exit_info.value.code == 2
    assert "--enable-lora: LoRA adapters are not supported yet" in capsys.readouterr().err


def test_startup_log_says_how_to_listen_on_every_interface(monkeypatch: pytest.MonkeyPatch,
                                                           caplog: pytest.LogCaptureFixture) -> None:
    from pagedllm.server import app as app_module

    class Server:
        started = True

        def __init__(self, *args: Any) -> None:
            pass

        def run(self) -> None:
            pass

    monkeypatch.setattr(app_module, "DrainingServer", Server)
    fake = SimpleNamespace(state=SimpleNamespace(pagedllm=SimpleNamespace(
        model_names=["m"], lifecycle=None, engine=SimpleNamespace(dead_error=None))))
    lines = []
    for host in ("127.0.0.1", "0.0.0.0"):
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="pagedllm.server"):
            app_module.run_server(fake, app_module.ServerSettings(host=host))
        lines.append(next(r.getMessage() for r in caplog.records if r.getMessage().startswith("serving")))
    assert "this machine only: --host 0.0.0.0 listens on every interface" in lines[0]
    assert "--host 0.0.0.0" not in lines[1]
