"""CUDA graphs of converted layers: ``fused_block.graphs.capture`` and ``make_graphed_callables``.

Argument checks run everywhere; capture and replay need a GPU (skipped, and reported as
skipped, without one; ``scripts/gpu_check.sh`` runs them). Replays are compared with eager
steps on the same inputs: the kernels are deterministic, so they must agree exactly, and with
dropout they must draw the masks an eager step draws after the same ``torch.cuda.manual_seed``.
Shapes are small (d_model 256, 4 heads of 64, 2 x 128 tokens): the checks are about graphs.
"""
import pytest
import torch
from torch import nn

import fused_block
from fused_block import graphs

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
DEV, DTYPE = "cuda", torch.bfloat16
D, H, FF, B, L = 256, 4, 1024, 2, 128


def _layer(norm_first, p):
    torch.manual_seed(0)
    ref = nn.TransformerEncoderLayer(D, H, FF, dropout=p, activation="gelu", batch_first=True, norm_first=norm_first)
    return fused_block.convert(ref).to(DEV, DTYPE)


def _train_step(layer, **kwargs):
    params = tuple(layer.parameters())

    def step(x, dy):
        y = layer(x, **kwargs)
        return (y, *torch.autograd.grad(y, (x, *params), dy))
    return step


def _inputs():
    x = torch.randn(B, L, D, device=DEV, dtype=DTYPE, requires_grad=True)
    return x, torch.randn(B, L, D, device=DEV, dtype=DTYPE)


def _assert_same(got, want):
    assert len(got) == len(want)
    for i, (a, b) in enumerate(zip(got, want)):
        assert torch.equal(a, b), f"output {i} differs: max |diff| {(a.float() - b.float()).abs().max().item()}"


# ---------------------------------------------------------------------------------------------
# argument checks (no GPU needed: they run before anything touches CUDA)
# ---------------------------------------------------------------------------------------------

def test_capture_rejects_bad_arguments():
    x = torch.randn(2, 3)
    with pytest.raises(TypeError, match="step must be callable"):
        graphs.capture(None, x)
    with pytest.raises(TypeError, match="warmup"):
        graphs.capture(lambda t: t, x, warmup=1.5)
    with pytest.raises(ValueError, match="warmup must be >= 1"):
        graphs.capture(lambda t: t, x, warmup=0)
    with pytest.raises(ValueError, match="at least one input"):
        graphs.capture(lambda: None)
    with pytest.raises(TypeError, match=r"inputs\[1\] must be a torch.Tensor"):
        graphs.capture(lambda a, b: a, x, 3.0)
    with pytest.raises(ValueError, match=r"inputs\[0\] is on cpu: CUDA graphs capture CUDA tensors only"):
        graphs.capture(lambda t: t, x)


# ---------------------------------------------------------------------------------------------
# capture and replay
# ---------------------------------------------------------------------------------------------

@cuda
@pytest.mark.parametrize("norm_first", [True, False])
def test_captured_training_step_equals_eager(norm_first):
    layer = _layer(norm_first, 0.0)
    step = _train_step(layer)
    graphed = graphs.capture(step, *_inputs())
    for _ in range(2):
        x, dy = _inputs()
        got = [t.clone() for t in graphed(x, dy)]
        _assert_same(got, step(x, dy))
    assert not any(t is x for t in graphed.inputs)  # the caller's tensors are copied, not captured


@cuda
@pytest.mark.parametrize("norm_first", [True, False])
def test_dropout_draws_new_masks_each_replay_as_eager_would(norm_first):
    layer = _layer(norm_first, 0.1)
    step = _train_step(layer)
    x, dy = _inputs()
    graphed = graphs.capture(step, x, dy)
    torch.cuda.manual_seed(7)
    first = [t.clone() for t in graphed(x, dy)]
    second = [t.clone() for t in graphed()]
    torch.cuda.manual_seed(7)
    _assert_same(first, step(x, dy))  # same seeds as eager: forward and backward masks agree
    assert not torch.equal(first[0], second[0])  # a replay draws new seeds


@cuda
def test_unhinted_causal_mask_keeps_the_kernel_in_the_graph(launches):
    layer = _layer(True, 0.0)
    mask = nn.Transformer.generate_square_subsequent_mask(L, device=DEV, dtype=DTYPE)
    step = _train_step(layer, src_mask=mask)
    graphed = graphs.capture(step, *_inputs())  # the warm-up reads the mask once
    x, dy = _inputs()
    before = launches["attention_fwd"]
    got = [t.clone() for t in graphed(x, dy)]
    assert launches["attention_fwd"] == before  # a replay launches from the graph, not Python
    _assert_same(got, _train_step(layer, is_causal=True)(x, dy))


@cuda
def test_replay_checks_its_inputs():
    graphed = graphs.capture(_train_step(_layer(True, 0.0)), *_inputs())
    x, dy = _inputs()
    with pytest.raises(TypeError, match="expected 2 inputs"):
        graphed(x)
    with pytest.raises(ValueError, match=r"inputs\[1\] must match the captured input"):
        graphed(x, dy[:, :-1])


@cuda
def test_capture_failure_says_what_a_graph_cannot_contain():
    """An error during capture comes back with what a graph cannot contain. (The step raises
    itself: a real host sync would leave the capture invalidated for the tests after it.)"""
    def step(t):
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError("operation not permitted when stream is capturing")
        return t * 2

    with pytest.raises(RuntimeError, match="cannot synchronize with the host") as e:
        graphs.capture(step, torch.randn(4, device=DEV))
    assert "operation not permitted" in str(e.value)


@cuda
def test_make_graphed_callables_on_converted_layers():
    """PyTorch's per-module graphs: forward and backward graphs, loss and .grad eager."""
    torch.manual_seed(0)
    stack = nn.Sequential(*(nn.TransformerEncoderLayer(D, H, FF, dropout=0.0, batch_first=True, norm_first=True)
                            for _ in range(2)))
    stack = fused_block.convert(stack).to(DEV, DTYPE)
    eager_stack = fused_block.convert(nn.Sequential(*(nn.TransformerEncoderLayer(
        D, H, FF, dropout=0.0, batch_first=True, norm_first=True) for _ in range(2)))).to(DEV, DTYPE)
    eager_stack.load_state_dict(stack.state_dict())
    x, dy = _inputs()
    graphed = torch.cuda.make_graphed_callables(stack, (x,))
    for _ in range(2):
        x, dy = _inputs()
        for model in (graphed, eager_stack):
            model.zero_grad(set_to_none=True)
        xg = x.detach().requires_grad_(True)
        graphed(xg).backward(dy)
        xe = x.detach().requires_grad_(True)
        eager_stack(xe).backward(dy)
        _assert_same([xg.grad, *(p.grad for p in stack.parameters())],
                     [xe.grad, *(p.grad for p in eager_stack.parameters())])
