"""torch.export, torch.jit.trace and torch.jit.script of the library's modules.

export and trace record the fused ops themselves (``fused_block::*`` nodes), so the exported
program and the traced module launch the kernels; a trace follows the input's shape (no
Python arithmetic on traced sizes). ``torch.jit.script`` cannot compile Python that launches
Triton kernels and says what to use instead. Shapes: d_model 32, 2 heads (head dim 16, the
kernel's smallest), tiny for the interpreter; traces are replayed at a second shape.
"""
import copy
import warnings

import pytest
import torch
from torch import nn

import fused_block

D, H, FF = 32, 2, 64


def _fused_nodes(graph_text):
    return graph_text.count("fused_block")


def _encoder(device):
    return fused_block.TransformerEncoderLayer(D, H, FF, dropout=0.0, batch_first=True, device=device).eval()


def _modules(device):
    return {
        "encoder": (_encoder(device), lambda s: (torch.randn(2, s, D, device=device),)),
        "decoder": (fused_block.TransformerDecoderLayer(D, H, FF, dropout=0.0, batch_first=True,
                                                        device=device).eval(),
                    lambda s: (torch.randn(2, s, D, device=device), torch.randn(2, s + 2, D, device=device))),
        "linear": (fused_block.Linear(D, FF, activation="gelu", device=device),
                   lambda s: (torch.randn(s, D, device=device),)),
        "layer_norm": (fused_block.LayerNorm(D, device=device), lambda s: (torch.randn(3, s, D, device=device),)),
        "mlp": (fused_block.MLP(D, FF, device=device), lambda s: (torch.randn(s, D, device=device),)),
    }


@pytest.fixture
def unforced_norms():
    """The norms' choice as a user has it (conftest forces our kernels in every other test): a
    trace takes the static rule, the fused op, whatever the bucket's verdict."""
    from fused_block import norm

    before = norm.force(None)
    yield
    norm.force(before)


@pytest.mark.parametrize("name", ["encoder", "decoder", "linear", "layer_norm", "mlp"])
def test_jit_trace_records_the_fused_ops_and_follows_the_shape(device, launches, unforced_norms, name):
    module, make = _modules(device)[name]
    args = make(5)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", torch.jit.TracerWarning)  # shape checks read sizes: expected
        traced = torch.jit.trace(module, args)
    assert _fused_nodes(str(traced.inlined_graph)) > 0
    with torch.no_grad():
        for s in (5, 7):
            args = make(s)
            torch.testing.assert_close(traced(*args), module(*args), atol=1e-5, rtol=1e-5)


def test_jit_trace_of_a_converted_transformer(device, launches, unforced_norms):
    model = fused_block.convert(nn.Transformer(D, H, 1, 1, FF, dropout=0.0, batch_first=True, device=device).eval())
    src, tgt = torch.randn(2, 6, D, device=device), torch.randn(2, 4, D, device=device)
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore", torch.jit.TracerWarning)
        traced = torch.jit.trace(model, (src, tgt))
        before = launches["attention_fwd"]
        torch.testing.assert_close(traced(src, tgt), model(src, tgt), atol=1e-5, rtol=1e-5)
    assert launches["attention_fwd"] > before


@pytest.mark.parametrize("name", ["encoder", "decoder", "linear", "layer_norm", "mlp"])
def test_torch_export_runs_the_fused_ops(device, launches, name):
    module, make = _modules(device)[name]
    args = make(5)
    program = torch.export.export(module, args)
    assert _fused_nodes(str(program.graph)) > 0
    with torch.no_grad():
        torch.testing.assert_close(program.module()(*args), module(*args), atol=1e-5, rtol=1e-5)


def test_torch_export_of_a_converted_transformer(device):
    model = fused_block.convert(nn.Transformer(D, H, 1, 1, FF, dropout=0.0, batch_first=True, device=device).eval())
    src, tgt = torch.randn(2, 6, D, device=device), torch.randn(2, 4, D, device=device)
    program = torch.export.export(model, (src, tgt))
    assert _fused_nodes(str(program.graph)) > 0
    with torch.no_grad():
        torch.testing.assert_close(program.module()(src, tgt), model(src, tgt), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", ["encoder", "decoder", "linear", "layer_norm", "mlp"])
def test_jit_script_raises_a_clear_error(device, name):
    module, _ = _modules(device)[name]
    with pytest.raises(TypeError, match=r"torch\.jit\.trace.*torch\.export\.export"):
        torch.jit.script(module)


class _WithPadding(nn.Module):
    def __init__(self, layer):
        super().__init__()
        self.layer = layer

    def forward(self, x, kpm):
        return self.layer(x, src_key_padding_mask=kpm)


@pytest.mark.parametrize("traced_with", ["causal", "zero", "additive-bool", "padding"])
def test_jit_trace_reads_no_mask_values(device, launches, traced_with):
    """A trace traced with a float mask of a special form (an unhinted causal mask, an all-zero
    mask, a 0/-inf mask, a 0/-inf padding mask) then given another mask: torch's layer reads
    the new mask; the trace once held the eager verdict on the first one (causal, dropped,
    converted to bool) and silently ignored or misread every later mask."""
    L = 6
    torch.manual_seed(0)
    t = nn.TransformerEncoderLayer(D, H, FF, 0.0, batch_first=True, device=device).eval()
    f = fused_block.convert(copy.deepcopy(t))
    hidden = torch.rand(L, L, device=device) < 0.3
    first = {"causal": nn.Transformer.generate_square_subsequent_mask(L, device=device),
             "zero": torch.zeros(L, L, device=device),
             "additive-bool": torch.zeros(L, L, device=device).masked_fill(hidden.fill_diagonal_(False),
                                                                           float("-inf")),
             "padding": torch.zeros(2, L, device=device).index_fill_(1, torch.tensor([4, 5], device=device),
                                                                      float("-inf"))}[traced_with]
    other = torch.randn(first.shape, device=device)  # a general float mask: nothing to read as a pattern
    module, ref = (_WithPadding(f), _WithPadding(t)) if traced_with == "padding" else (f, t)
    x = torch.randn(2, L, D, device=device)
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore", torch.jit.TracerWarning)
        traced = torch.jit.trace(module, (x, first))
    for mask in (first, other):
        x = torch.randn(2, L, D, device=device)
        with torch.no_grad():
            got = traced(x, mask)
        want = ref(x, mask)  # grad mode on: torch's eager math, not its inference fast path
        torch.testing.assert_close(got, want.detach(), atol=1e-5, rtol=1e-5)
    assert launches["attention_fwd"] > 0


def test_backward_through_a_jit_trace_raises(device, launches):
    """A trace holds the fused ops, not their autograd Functions: backward through its output
    ran (a warning at most) and left every parameter's and the input's .grad None, where torch's
    traced layer trains. It raises now, naming the op; the trace still runs inference."""
    module = fused_block.TransformerEncoderLayer(D, H, FF, dropout=0.0, batch_first=True, device=device)
    x = torch.randn(2, 5, D, device=device, requires_grad=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", torch.jit.TracerWarning)
        traced = torch.jit.trace(module, (x,), check_trace=False)
    out = traced(x)
    with pytest.raises(RuntimeError, match=r"fused_block::\w+ has no gradient.*inference graph"):
        out.sum().backward()
    with torch.no_grad():
        torch.testing.assert_close(traced(x), module(x), atol=1e-5, rtol=1e-5)
    assert launches["attention_fwd"] > 0
