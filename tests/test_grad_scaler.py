"""fp16 mixed precision with ``torch.amp.GradScaler``: a converted layer's step is skipped
exactly when torch's layer's step is (docs/numerics.md, "GradScaler").

GradScaler learns of an overflow only from non-finite parameter gradients, so a fused backward
that turned an overflow into a finite value would have it apply a corrupted step and keep
growing its scale. The cases are far from any threshold, so the statement holds on every
device: a loss scale of 2^8 fits fp16 (no skip), 2^48 overflows every gradient (skip), and an
inf or NaN in the input reaches every parameter's gradient (skip). Dropout 0.1 is on, so the
norms', attention's and GEMMs' dropout kernels run in the step.

Shapes: d_model 32 with 2 heads (head dim 16, the kernel's smallest), 9 tokens (no multiple
of a block size), batch 2; tiny because the suite runs through the Triton interpreter.
"""
import copy

import pytest
import torch

import fused_block

CASES = {"scale_fits": (2.0 ** 8, None), "scale_overflows": (2.0 ** 48, None),
         "inf_input": (2.0 ** 8, float("inf")), "nan_input": (2.0 ** 8, float("nan"))}


def _step(layer, x, scale, device):
    """One GradScaler step of SGD; returns (skipped, scale after update, whether any parameter moved)."""
    opt = torch.optim.SGD(layer.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler(device.type, init_scale=scale)
    before = [p.detach().clone() for p in layer.parameters()]
    with torch.autocast(device.type, dtype=torch.float16):
        y = layer(x)
    scaler.scale(y.float().pow(2).mean()).backward()
    scaler.step(opt)
    scaler.update()
    moved = any(not torch.equal(b, p.detach()) for b, p in zip(before, layer.parameters()))
    return scaler.get_scale() < scale, scaler.get_scale(), moved


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("norm_first", [True, False])
def test_converted_layer_s_step_is_skipped_when_torch_s_is(case, norm_first, device, launches):
    scale, bad = CASES[case]
    original = torch.nn.TransformerEncoderLayer(32, 2, 64, dropout=0.1, batch_first=True,
                                                norm_first=norm_first).to(device)
    fused = fused_block.convert(copy.deepcopy(original))
    x = torch.randn(2, 9, 32, device=device)
    if bad is not None:
        x[1, 4, 7] = bad
    want = _step(original, x, scale, device)
    got = _step(fused, x, scale, device)
    assert got == want, f"torch's step (skipped, next scale, moved) {want}, the converted layer's {got}"
    assert want == ((True, scale / 2, False) if case != "scale_fits" else (False, scale, True))
    for kernel in ("add_norm_fwd", "add_norm_bwd", "attention_fwd", "attention_bwd", "matmul"):
        assert launches[kernel] > 0, kernel


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_converted_hugging_face_model_s_step_is_skipped_when_torch_s_is(arch, device, launches):
    """The same on a converted causal LM (tests/hf_testing.py's tiny models, left padding,
    the loss through the fused linear cross-entropy): a scale that fits, then one that
    overflows, each from a fresh GradScaler."""
    pytest.importorskip("transformers")
    import hf_testing
    original = hf_testing.model(arch, device).train()
    with hf_testing.no_fallback():
        fused = fused_block.convert(copy.deepcopy(original))
    ids, mask = hf_testing.inputs(arch, device)
    labels = ids.masked_fill(mask == 0, -100)

    def step(model, scale):
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        scaler = torch.amp.GradScaler(device.type, init_scale=scale)
        with torch.autocast(device.type, dtype=torch.float16):
            loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
        return scaler.get_scale()

    for scale, skipped in ((2.0 ** 8, False), (2.0 ** 48, True)):
        want = step(original, scale)
        assert want == (scale / 2 if skipped else scale)
        assert step(fused, scale) == want, f"scale {scale}: torch's next scale {want}"
    for kernel in ("add_norm_bwd", "attention_bwd", "matmul", "lce_dh"):
        assert launches[kernel] > 0, kernel
