"""``python -m bench --profile SPEC``: the kernel table of one step, on synthetic events and on a
real CPU profile (the CUDA activity itself needs a GPU: ``python -m bench --profile block,hf``),
its results file, the command line, the specs' profile cases, and the Liger provider's scoping
of the names Liger replaces in transformers' modeling module."""
import json
import pathlib
import sys
import types

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # bench/ is a top-level folder of the checkout, not installed
    sys.path.insert(0, str(ROOT))

from bench import harness  # noqa: E402

ENV = {"date": "2026-12-04T12:00:00+00:00", "torch": "2.11.0", "triton": "3.6.0", "python": "3.12.3",
       "cuda": "13.0", "gpu": "NVIDIA H200", "driver": "580.159.04"}
# (name, us): one step's kernels as a CUDA profile lists them.
EVENTS = [("_gemm_kernel", 120.0), ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x256x64", 80.0),
          ("_gemm_kernel", 100.0), ("_attn_fwd", 50.0), ("flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel", 70.0),
          ("_add_norm_fwd_kernel", 10.0), ("_epilogue_kernel", 8.0), ("triton_poi_fused_gelu_0", 6.0),
          ("Memcpy DtoD (Device -> Device)", 4.0), ("triton_tem_fused_mm_1", 30.0), ("nll_loss_forward_kernel", 2.0)]


def test_kernel_rows_group_sort_and_share():
    rows = harness.kernel_rows(EVENTS)
    assert [r["kernel"] for r in rows[:2]] == ["_gemm_kernel", EVENTS[1][0]]
    assert rows[0]["calls"] == 2 and rows[0]["us"] == 220.0
    assert abs(sum(r["share"] for r in rows) - 1.0) < 1e-12
    assert rows[0]["share"] == pytest.approx(220.0 / 480.0)
    cats = {r["kernel"]: r["category"] for r in rows}
    assert cats["_gemm_kernel"] == cats["triton_tem_fused_mm_1"] == "gemm"
    assert cats["sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x256x64"] == "gemm"
    assert cats["_attn_fwd"] == cats["flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel"] == "attention"
    assert cats["_add_norm_fwd_kernel"] == "norm" and cats["nll_loss_forward_kernel"] == "loss"
    assert cats["Memcpy DtoD (Device -> Device)"] == "copy/fill"
    assert cats["_epilogue_kernel"] == cats["triton_poi_fused_gelu_0"] == "elementwise/other"
    assert harness.kernel_rows([]) == []


def _profiles():
    ours = harness.summarize_profile("fused_block", harness.kernel_rows(EVENTS), 0.61)
    eager = harness.summarize_profile("eager", harness.kernel_rows(EVENTS[1:5] * 2), None)
    return ours, eager


def test_summary_and_format():
    ours, eager = _profiles()
    assert ours["launches"] == len(EVENTS) and ours["distinct"] == len(EVENTS) - 1
    assert ours["kernel_ms"] == pytest.approx(0.48)
    assert ours["categories"]["gemm"] == {"calls": 4, "us": 330.0}
    text = harness.format_profiles("block_pre_ln 1024 bfloat16 fwd+bwd", [ours, eager], top=3)
    lines = text.splitlines()
    assert lines[0] == "== profile: block_pre_ln 1024 bfloat16 fwd+bwd =="
    assert "fused_block" in lines[1] and "eager" in lines[1]
    assert lines[2].split()[-2:] == ["0.610", "-"]  # step wall ms; eager's was not given
    assert any(line.startswith("gemm ms (n)") and "0.330 (4)" in line for line in lines)
    assert any(line.startswith("loss ms (n)") and line.rstrip().endswith("-") for line in lines)
    assert "-- fused_block: 11 launches, 0.480 ms of kernels --" in lines
    assert any("(7 more kernels)" in line for line in lines)  # 10 names, top 3
    top = lines[lines.index("-- fused_block: 11 launches, 0.480 ms of kernels --") + 2].split()
    assert top[:3] == ["2", "220.0", "45.8%"] and top[-1] == "_gemm_kernel"


def test_profile_step_on_a_cpu_profile():
    # Without a GPU the profiler's CPU ops stand in for kernels (self time: ops nest there).
    a, b = torch.randn(64, 64), torch.randn(64, 64)
    calls = []

    def step():
        calls.append(1)
        return torch.relu(a @ b).sum()

    prof = harness.profile_step("cpu", step, warmup=2)
    assert len(calls) == 3 and prof["step_ms"] > 0
    names = {r["kernel"] for r in prof["kernels"]}
    assert {"aten::mm", "aten::relu", "aten::sum"} <= names
    assert abs(sum(r["share"] for r in prof["kernels"]) - 1.0) < 1e-9
    assert prof["launches"] == sum(r["calls"] for r in prof["kernels"])
    assert "aten::mm" in harness.format_profiles("cpu step", [prof])


def test_profiles_go_into_the_results_json(tmp_path):
    ours, eager = _profiles()
    record = {"spec": "block", "op": "block_pre_ln", "shape": {"d_model": 1024}, "dtype": "bfloat16",
              "mode": "fwd+bwd", "profiles": [ours, eager], "unavailable": {"torch.compile": "RuntimeError: x"},
              "dispatch": [{"op": "linear.fwd", "candidate": "triton"}]}
    paths = harness.write_results(str(tmp_path), ENV, {}, [], quick=True, plots=False, profiles=[record],
                                  suffix="-profile")
    assert paths[0].endswith("nvidia-h200-2026-12-04-quick-profile.json")
    data = json.loads(pathlib.Path(paths[0]).read_text())
    assert data["profiles"][0]["profiles"][0]["kernels"][0]["kernel"] == "_gemm_kernel"
    assert data["profiles"][0]["dispatch"][0]["candidate"] == "triton"
    plain = harness.write_results(str(tmp_path), ENV, {}, [], quick=True, plots=False)
    assert "profiles" not in json.loads(pathlib.Path(plain[0]).read_text())


def test_command_line(capsys):
    import bench.__main__ as main

    assert main.parse_args(["--profile", "block, hf"]).profile == ["block", "hf"]
    with pytest.raises(SystemExit):
        main.parse_args(["--profile", "nope"])
    assert "no spec named nope" in capsys.readouterr().err
    if not torch.cuda.is_available():
        assert main.main(["--profile", "block"]) == 2
        assert "--profile needs an NVIDIA GPU" in capsys.readouterr().out


def test_profile_cases_of_the_specs():
    import bench.__main__ as main
    from bench.specs import block, hf, norm

    (case,) = main.profile_cases(block)
    assert case.mode == "fwd+bwd"
    assert list(case.providers) == ["fused_block", "fused_block[triton]", "eager", "torch.compile"]
    assert case.shape["d_model"] == 1024 and case.shape["batch"] == 8
    (case,) = main.profile_cases(hf)
    assert case.op == "hf_train" and case.shape["model"] == "llama-1b" and case.shape["n_layer"] == 4
    # llama-1b's loss on the memory rule's vocabulary-outer schedule: also on the token loop
    assert list(case.providers)[:5] == ["fused_block", "fused_block[triton]", "fused_block[rows]", "eager",
                                        "torch.compile"]
    assert ("liger" in case.providers) == hf.liger_available()
    default = main.profile_cases(norm)  # no profile_cases(): its first quick training case
    assert len(default) <= 1 and all(c.mode == "fwd+bwd" for c in default)


def test_liger_replacements_are_scoped_to_its_steps(monkeypatch):
    # Liger's apply_liger_kernel_to_llama(model=...) patches the instance and also replaces
    # names of transformers' modeling_llama for every LLaMA: undone after the call, put back
    # only inside the provider's steps. A stand-in for liger_kernel.transformers here.
    from transformers.models.llama import modeling_llama

    from bench.specs import hf

    original = modeling_llama.apply_rotary_pos_emb
    seen = {}

    def fake_rope(*args, **kwargs):
        raise AssertionError("not called here")

    def apply(model=None):
        seen["model"] = model
        modeling_llama.apply_rotary_pos_emb = fake_rope
        modeling_llama.LigerOnly = 1

    fake = types.ModuleType("liger_kernel.transformers")
    fake.apply_liger_kernel_to_llama = apply
    monkeypatch.setitem(sys.modules, "liger_kernel", types.ModuleType("liger_kernel"))
    monkeypatch.setitem(sys.modules, "liger_kernel.transformers", fake)
    model = object()
    scope = hf._liger(model, "llama")
    assert seen["model"] is model
    assert modeling_llama.apply_rotary_pos_emb is original and not hasattr(modeling_llama, "LigerOnly")
    with scope():
        assert modeling_llama.apply_rotary_pos_emb is fake_rope and modeling_llama.LigerOnly == 1
    assert modeling_llama.apply_rotary_pos_emb is original and not hasattr(modeling_llama, "LigerOnly")


def test_provider_scopes_force_our_kernels_or_the_loss_token_loop():
    """``[triton]``: every op on our kernels (GEMMs, norms, attention); ``[rows]``: the loss's
    token loop (for the training steps whose loss the memory rule puts on the vocabulary-outer
    schedule); each undone after. The norm spec times ours both ways."""
    from fused_block import _attn_sdpa, dispatch, norm
    from fused_block.kernels import loss
    from bench.specs import hf
    from bench.specs import norm as norm_spec

    before, prefer = dispatch._FORCE, loss.PREFER
    norms, attention = norm.force(None), _attn_sdpa.force(None)
    try:
        with harness.provider_scope("fused_block[triton]"):
            assert dispatch._FORCE == "triton" and loss.PREFER == prefer
            assert norm._FORCED == norm.TRITON and _attn_sdpa._FORCED == _attn_sdpa.TRITON
        assert dispatch._FORCE == before and norm._FORCED is None and _attn_sdpa._FORCED is None
    finally:
        norm.force(norms)
        _attn_sdpa.force(attention)
    assert list(norm_spec.IMPLS)[:2] == ["fused_block", "fused_block[triton]"]
    with harness.provider_scope("fused_block[rows]"):
        assert loss.PREFER == "rows" and dispatch._FORCE == before
        assert loss.schedule(8192, 32000, 2048, 2, False, True, True) == "rows"
    assert loss.PREFER == prefer
    with harness.provider_scope("fused_block"):
        assert dispatch._FORCE == before and loss.PREFER == prefer
    rows = {name for name, spec in hf.MODELS.items() if "fused_block[rows]" in hf._train_providers(spec)}
    assert rows == {"llama-1b", "gemma-2b"}  # gpt2-small's loss is on the token loop already; T5's is not fused


def test_timed_choices_are_json_rows(monkeypatch):
    """The norms' and attention's verdicts, as the profile records keep them: op, bucket (its
    fields as strings: dtypes are not JSON), candidate and each candidate's milliseconds."""
    from bench.__main__ import timed_choices
    from fused_block import _attn_sdpa
    from fused_block import norm as fnorm

    monkeypatch.setattr(fnorm, "_CHOSEN", {(90, True, torch.bfloat16, True, True, False, 4096, 16384, True, False):
                                           ("torch", {"triton": 0.5, "torch": 0.4})})
    monkeypatch.setattr(_attn_sdpa, "_CHOSEN", {(90, torch.bfloat16, True, True, 64, 1, 512, 1024, 1024):
                                                ("sdpa_cudnn", {"triton": 1.0, "sdpa_cudnn": 0.8})})
    rows = json.loads(json.dumps(timed_choices()))
    assert [(r["op"], r["candidate"]) for r in rows] == [("norm", "torch"), ("attention", "sdpa_cudnn")]
    assert rows[0]["bucket"][2] == "torch.bfloat16" and rows[0]["ms"] == {"triton": 0.5, "torch": 0.4}

