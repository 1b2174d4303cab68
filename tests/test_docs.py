"""The front page and docs/: every code block checked, every link resolving, the speedup table
generated.

- Every ``python`` block of README.md and docs/*.md parses, and every ``fused_block`` name it
  uses exists: attribute chains (``fused_block.attention``), ``from fused_block... import``
  names, and the keywords of calls into the library bind to the callable's signature.
- The README's quickstarts run (on CPU through the Triton interpreter when there is no GPU:
  ``device = "cuda"`` becomes the test device), the Hugging Face one on a tiny saved LLaMA
  (its ``path = "..."`` replaced), with kernel launches counted and no fallback warning.
- ``bash`` blocks name make targets the Makefile has, ``python -m`` modules that exist, options
  their parsers accept, and files that exist.
- Relative links (and their ``#anchors``) resolve; docs/README.md lists every page.
- README.md stays under 250 lines, and its speedup section is what ``python -m bench.report``
  renders from the committed ``bench/results/*.json``.
"""
import ast
import importlib
import importlib.util
import inspect
import pathlib
import re
import shlex
import sys
import warnings

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # bench/ is a top-level folder of the checkout, not installed
    sys.path.insert(0, str(ROOT))

import fused_block  # noqa: E402

PAGES = [ROOT / "README.md"] + sorted((ROOT / "docs").glob("*.md"))
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)


def blocks(page, lang):
    text = page.read_text(encoding="utf-8")
    return [(text[:m.start()].count("\n") + 1, m.group(2)) for m in FENCE.finditer(text) if m.group(1) == lang]


def _ids(items):
    return [f"{page.relative_to(ROOT)}:{line}" for page, line, _ in items]


PYTHON = [(p, line, code) for p in PAGES for line, code in blocks(p, "python")]
BASH = [(p, line, code) for p in PAGES for line, code in blocks(p, "bash")]


def test_readme_is_a_front_page():
    lines = (ROOT / "README.md").read_text(encoding="utf-8").count("\n")
    assert lines < 250, f"README.md has {lines} lines: move reference material into docs/"


def test_there_are_blocks_to_check():
    assert len(PYTHON) >= 15 and len(BASH) >= 5


def _dotted(node):
    """``fused_block.a.b`` for an Attribute chain rooted at a Name, else None."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        return ".".join([node.id] + parts[::-1])
    return None


def _resolve(dotted):
    parts = dotted.split(".")
    obj = importlib.import_module(parts[0])
    for i, part in enumerate(parts[1:], 1):
        if hasattr(obj, part):
            obj = getattr(obj, part)
        else:  # a submodule not imported yet (fused_block.hf, fused_block.graphs, ...)
            obj = importlib.import_module(".".join(parts[:i + 1]))
    return obj


@pytest.mark.parametrize("page,line,code", PYTHON, ids=_ids(PYTHON))
def test_python_block_names_real_api(page, line, code):
    tree = ast.parse(code, filename=f"{page.name}:{line}")
    aliases = {}  # local name -> the library object it was imported as
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "fused_block":
            module = importlib.import_module(node.module)  # the module, even where a function shadows its name
            for a in node.names:
                if not hasattr(module, a.name):
                    try:
                        spec = importlib.util.find_spec(f"{node.module}.{a.name}")
                    except ImportError:  # node.module is a module, not a package
                        spec = None
                    assert spec, f"{page.name}:{line}: from {node.module} import {a.name}: no such name"
                    aliases[a.asname or a.name] = importlib.import_module(f"{node.module}.{a.name}")
                else:
                    aliases[a.asname or a.name] = getattr(module, a.name)
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "fused_block":
                    assert importlib.util.find_spec(a.name), f"{page.name}:{line}: import {a.name}: no such module"
    checked = 0
    for node in ast.walk(tree):
        target = node.func if isinstance(node, ast.Call) else node
        dotted = _dotted(target) if isinstance(target, (ast.Attribute, ast.Name)) else None
        if dotted is None:
            continue
        head, *rest = dotted.split(".")
        try:
            if head in aliases:
                obj = aliases[head]
                for part in rest:
                    obj = getattr(obj, part)
            elif head == "fused_block":
                obj = _resolve(dotted)
            else:
                continue
        except (AttributeError, ImportError) as exc:
            pytest.fail(f"{page.name}:{line}: {dotted} does not exist ({exc})")
        checked += 1
        if isinstance(node, ast.Call) and callable(obj):
            keywords = {k.arg: None for k in node.keywords if k.arg is not None}
            try:
                sig = inspect.signature(obj.__init__ if inspect.isclass(obj) else obj)
            except (TypeError, ValueError):
                continue
            params = list(sig.parameters.values())
            if any(p.kind is p.VAR_KEYWORD for p in params):
                continue
            names = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
            unknown = sorted(set(keywords) - names)
            assert not unknown, f"{page.name}:{line}: {dotted}() takes no keyword {', '.join(unknown)}"
    if "fused_block" in code:
        assert checked, f"{page.name}:{line}: a block about fused_block that names none of it"


def _make_targets():
    text = (ROOT / "Makefile").read_text(encoding="utf-8")
    return set(re.findall(r"^([A-Za-z][\w-]*):", text, re.M))


def _parser_accepts(module, options):
    """The ``python -m`` modules with argparse parsers: each option given must be one of theirs."""
    if module == "bench":
        import bench.__main__ as m
        parser_src = inspect.getsource(m.parse_args)
    elif module == "bench.report":
        from bench import report as m
        parser_src = inspect.getsource(m.main)
    else:
        return
    for opt in options:
        assert f'"{opt}"' in parser_src, f"python -m {module} has no option {opt}"


@pytest.mark.parametrize("page,line,code", BASH, ids=_ids(BASH))
def test_bash_block_names_real_targets_modules_and_files(page, line, code):
    targets = _make_targets()
    for raw in code.splitlines():
        cmd = raw.split("#", 1)[0].strip()
        if not cmd:
            continue
        words = shlex.split(cmd)
        env_free = [w for w in words if not re.match(r"^[A-Z_]+=", w)]
        if env_free[:1] == ["make"]:
            for t in (w for w in env_free[1:] if not w.startswith("-")):
                assert t in targets, f"{page.name}:{line}: make {t}: no such target"
        if "-m" in env_free:
            module = env_free[env_free.index("-m") + 1]
            if module.split(".")[0] in ("bench", "fused_block"):
                assert importlib.util.find_spec(module), f"{page.name}:{line}: python -m {module}: no such module"
                _parser_accepts(module, [w.split("=")[0] for w in env_free if w.startswith("--")])
        for w in env_free:
            if re.match(r"^(scripts|examples|tests|bench|kernels|fused_block)/[\w/.-]+\.(py|sh)$", w):
                assert (ROOT / w).exists(), f"{page.name}:{line}: {w} does not exist"


# ---------------------------------------------------------------------------------------------
# the README's quickstarts run
# ---------------------------------------------------------------------------------------------

@pytest.fixture
def tiny_llama_path(tmp_path):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   initializer_range=0.2, bos_token_id=0, eos_token_id=95, pad_token_id=0)
    transformers.LlamaForCausalLM(cfg).save_pretrained(tmp_path / "tiny-llama")
    return str(tmp_path / "tiny-llama")


QUICKSTARTS = blocks(ROOT / "README.md", "python")


@pytest.mark.parametrize("index", range(len(QUICKSTARTS)), ids=[f"README.md:{line}" for line, _ in QUICKSTARTS])
def test_readme_quickstart_runs(index, device, launches, request):
    line, code = QUICKSTARTS[index]
    assert 'device = "cuda"' in code or 'device, dt = "cuda"' in code, (
        "a quickstart names its device once, as device = \"cuda\", so this test can run it anywhere")
    code = code.replace('"cuda"', repr(device.type))
    scope = {"__name__": "readme_quickstart"}
    if "from_pretrained(path" in code:  # no download here: the README's checkpoint becomes a tiny saved LLaMA
        named = re.search(r'^path = ("[^"]+")', code, re.M)
        assert named, "the Hugging Face quickstart names its checkpoint as path = \"...\""
        code = code.replace(named.group(0), f"path = {request.getfixturevalue('tiny_llama_path')!r}")
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="fused_block:")  # nothing falls back to the original path
        exec(compile(code, f"README.md:{line}", "exec"), scope)  # noqa: S102 - the README's own code
    from fused_block.kernels import common

    assert sum(launches[name] for name in common.LAUNCHES) > 0, "the quickstart ran no fused kernel"


# ---------------------------------------------------------------------------------------------
# links and the index
# ---------------------------------------------------------------------------------------------

LINK = re.compile(r"\]\(([^)\s]+)\)")


def _anchor(heading):
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*]", "", heading.strip().lower())
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def _anchors(page):
    text = FENCE.sub("", page.read_text(encoding="utf-8"))
    return {_anchor(m.group(1)) for m in re.finditer(r"^#+ (.*)$", text, re.M)}


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_relative_links_resolve(page):
    text = FENCE.sub("", page.read_text(encoding="utf-8"))
    for target in LINK.findall(text):
        if re.match(r"^[a-z]+://", target):
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        assert dest.exists(), f"{page.relative_to(ROOT)}: link to {target}: no such file"
        if anchor and dest.suffix == ".md":
            assert anchor in _anchors(dest), f"{page.relative_to(ROOT)}: link to {target}: no such heading"


def test_docs_index_lists_every_page():
    index = (ROOT / "docs" / "README.md").read_text(encoding="utf-8")
    listed = set(LINK.findall(index))
    missing = [p.name for p in PAGES[1:] if p.name != "README.md" and p.name not in listed]
    assert not missing, f"docs/README.md does not list {missing}"


# ---------------------------------------------------------------------------------------------
# the speedup table is generated
# ---------------------------------------------------------------------------------------------

def test_readme_speedup_table_is_what_the_committed_results_render(capsys):
    from bench import report

    assert report.main(["--check"]) == 0, capsys.readouterr().out


# ---------------------------------------------------------------------------------------------
# inspectable state the pages spell out
# ---------------------------------------------------------------------------------------------

def test_dispatch_table_fields_are_the_documented_ones(device):
    """docs/dispatch.md's "Which candidate ran" lists a row's fields: exactly the keys
    ``fused_block.dispatch_table()`` gives (a user reads them by name)."""
    code = blocks(ROOT / "docs" / "dispatch.md", "python")
    comment = next(c for _, c in code if "dispatch_table()" in c).split("dispatch_table()", 1)[1]
    documented = re.search(r"#\s*\[\{([^}]*)\}", comment).group(1)
    fields = [f.strip() for f in documented.split(",")]
    fused_block.dispatch.clear()
    try:
        x = torch.randn(3, 16, device=device)  # one tiny product: a row to read the fields of
        fused_block.linear(x, torch.randn(8, 16, device=device))
        rows = fused_block.dispatch_table()
    finally:
        fused_block.dispatch.clear()
    assert rows and all(list(r) == fields for r in rows), (fields, rows)
