"""Architecture rules checked by reading imports (code-models.md 7.2): sans-I/O cores, numba
only in kernels, scapy only where dissection happens."""

from __future__ import annotations

import ast
import functools
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


@functools.cache
def _tree(path: Path) -> ast.Module:
    """*path* parsed once for all the rules here (every rule walks every module: parsing each
    file again per rule took ~20 s of the suite)."""
    return ast.parse(path.read_text())


IO_MODULES = {"socket", "asyncio", "selectors", "threading", "time", "asyncio_dgram", "subprocess"}
#: Sans-I/O cores: protocol logic that takes datagrams and `now` and returns datagrams and events.
CORES = [
    "protocol/constants.py",
    "protocol/packet.py",
    "protocol/errors.py",
    "netdam/core/node.py",
    "netdam/core/fabric.py",
    "netdam/core/host.py",
    "netdam/core/faults.py",
    "netdam/core/events.py",
    "protocol/counters.py",
    "switch/core.py",
    "switch/addrmap.py",
    "switch/faults.py",
]


def imports_of(path: Path) -> set[str]:
    tree = _tree(path)
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


def test_cores_do_no_io() -> None:
    for rel in CORES:
        assert not imports_of(ROOT / rel) & IO_MODULES, rel


def test_numba_only_in_kernels() -> None:
    for path in (
        list((ROOT / "netdam").rglob("*.py"))
        + list((ROOT / "protocol").rglob("*.py"))
        + list((ROOT / "switch").rglob("*.py"))
    ):
        if "kernels" in path.parts:
            continue
        assert "numba" not in imports_of(path), path


def test_scapy_imported_lazily() -> None:
    """scapy at module level only in the scapy layer; everything else imports it inside functions."""
    for path in (
        list((ROOT / "netdam").rglob("*.py"))
        + list((ROOT / "protocol").rglob("*.py"))
        + list((ROOT / "switch").rglob("*.py"))
    ):
        if path.name == "scapy_layer.py":
            continue
        tree = _tree(path)
        top = {
            n.module.split(".")[0] for n in tree.body if isinstance(n, ast.ImportFrom) and n.module
        }
        top |= {
            a.name.split(".")[0] for n in tree.body if isinstance(n, ast.Import) for a in n.names
        }
        assert "scapy" not in top, path


# ---------------------------------------------------------------- the house's rooms (issue 13)

PACKAGE_DIRS = {
    "netdam": ROOT / "netdam",
    "netdam.protocol": ROOT / "protocol",
    "netdam.switch": ROOT / "switch",
    "netdam.fpga_model": ROOT / "fpga_model",
}
#: Rooms whose code may touch sockets, clocks and processes: the shell, and what is a shell
#: itself (clients, cluster tools, commands and tools, the switch's process and launch side).
SHELL_ROOMS = (
    "netdam/shell/",
    "netdam/clients/",
    "netdam/cluster/",
    "netdam/cli/",
    "netdam/tools/",
    "netdam/progress.py",
    "netdam/api.py",
    "switch/process.py",
    "switch/cli.py",
    "switch/controller.py",
    "switch/state.py",
    "protocol/fixtures/",
    "protocol/scapy_layer.py",
)
SYSCALL_MODULES = {
    "socket",
    "select",
    "selectors",
    "time",
    "subprocess",
    "threading",
    "asyncio",
    "asyncio_dgram",
    "signal",
    "multiprocessing",
}


def our_modules() -> dict[str, Path]:
    """Dotted name -> file of every module we ship."""
    found: dict[str, Path] = {}
    for package, folder in PACKAGE_DIRS.items():
        for path in folder.rglob("*.py"):
            if package == "netdam" and path.relative_to(folder).parts[0] in (
                "protocol",
                "switch",
                "fpga_model",
            ):
                continue
            rel = path.relative_to(folder).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            found[".".join([package, *parts])] = path
    return found


def module_level_imports(path: Path) -> set[str]:
    """Dotted names imported at module level (outside functions; TYPE_CHECKING blocks excluded)."""
    names: set[str] = set()
    tree = _tree(path)
    todo: list[ast.stmt] = list(tree.body)
    while todo:
        node = todo.pop()
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            continue
        if isinstance(node, (ast.If, ast.Try)):
            todo.extend(node.body + node.orelse + getattr(node, "finalbody", []))
            for handler in getattr(node, "handlers", []):
                todo.extend(handler.body)
        elif isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names |= {f"{node.module}.{a.name}" for a in node.names}
    return names


def test_no_import_cycles() -> None:
    modules = our_modules()
    graph = {
        name: {m for m in module_level_imports(path) if m in modules and m != name}
        for name, path in modules.items()
    }
    state: dict[str, int] = {}

    def visit(name: str, stack: list[str]) -> None:
        state[name] = 1
        for dep in sorted(graph[name]):
            if state.get(dep) == 1:
                raise AssertionError(
                    "import cycle: " + " -> ".join(stack[stack.index(dep) :] + [dep])
                )
            if dep not in state:
                visit(dep, stack + [dep])
        state[name] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])


def test_protocol_imports_nothing_of_ours_outside_protocol() -> None:
    for path in (ROOT / "protocol").rglob("*.py"):
        ours = {
            m
            for m in module_level_imports(path) | _function_imports(path)
            if m.startswith("netdam")
        }
        assert all(m.startswith("netdam.protocol") for m in ours), (path, ours)


#: Everything the CLI drives, below it (docs/ARCHITECTURE.md): none of it imports the CLI.
BELOW_THE_CLI = (
    "netdam.tools",
    "netdam.clients",
    "netdam.cluster",
    "netdam.shell",
    "netdam.core",
    "netdam.kernels",
    "netdam.protocol",
    "netdam.fpga_model",
    "netdam.api",
    "netdam.outcome",
)


def test_nothing_below_the_cli_imports_it() -> None:
    """Engines (fuzz, benches, plots) raise netdam.outcome's errors; the CLI parses and prints."""
    for name, path in our_modules().items():
        if name.startswith(BELOW_THE_CLI):
            ours = module_level_imports(path) | _function_imports(path)
            assert not any(m == "netdam.cli" or m.startswith("netdam.cli.") for m in ours), (
                name,
                ours,
            )


def test_only_shells_touch_sockets_clocks_and_processes() -> None:
    for path in our_modules().values():
        rel = path.relative_to(ROOT).as_posix()
        if rel.startswith(SHELL_ROOMS) or rel.startswith("fpga_model/"):
            continue
        if "kernels" in path.parts:
            continue  # compiled code reaches libc through numba, not through these modules
        assert not imports_of(path) & SYSCALL_MODULES, (rel, imports_of(path) & SYSCALL_MODULES)


def test_every_error_derives_from_netdam_error() -> None:
    """A user catches NetdamError for anything we raise on purpose."""
    classes: dict[str, list[str]] = {}
    for path in our_modules().values():
        for node in ast.walk(_tree(path)):
            if isinstance(node, ast.ClassDef):
                classes[node.name] = [ast.unparse(b).split(".")[-1] for b in node.bases]

    def rooted(name: str, seen: frozenset[str] = frozenset()) -> bool:
        if name == "NetdamError":
            return True
        return (
            name in classes
            and name not in seen
            and any(rooted(b, seen | {name}) for b in classes[name])
        )

    for name, bases in classes.items():
        if name.endswith(("Error", "Failure", "Timeout", "Conflict", "Stopped", "Problem")):
            assert rooted(name), f"{name}({', '.join(bases)}) does not derive from NetdamError"


WIRE_STRUCT = re.compile(
    r"""struct\.(pack|unpack|unpack_from|pack_into|Struct)\(\s*["'][<>!]?[IQHB]"""
)


def test_wire_structs_live_in_protocol() -> None:
    """Payload layouts are protocol/'s (payloads.py, packet.py): the rest packs through them.
    The fuzzer's mutations and the stdlib-only examples are exempt: they forge bytes on purpose."""
    for path in our_modules().values():
        rel = path.relative_to(ROOT).as_posix()
        if rel.startswith(("protocol/", "netdam/tools/fuzz/", "netdam/kernels/")):
            continue
        hits = [m.group(0) for m in WIRE_STRUCT.finditer(path.read_text())]
        assert not hits, (rel, hits)


def test_function_level_imports_say_why() -> None:
    """A function-level import avoids an optional dependency (scapy, matplotlib, torch) or
    numba's start-up cost, and a comment above it (or above its group) says so (issue 13)."""
    for name, path in our_modules().items():
        if name == "netdam":
            continue  # the package's lazy attribute loader
        lines = path.read_text().split("\n")
        tree = _tree(path)
        for fn in ast.walk(tree):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(fn):
                if isinstance(node, (ast.Import, ast.ImportFrom)):
                    above = lines[node.lineno - 2].strip()
                    explained = (
                        above.startswith(("#", "import ", "from "))
                        or "# " in lines[node.lineno - 1]
                    )
                    assert explained, (
                        f"{path.relative_to(ROOT)}:{node.lineno}: say why this import is not at the top"
                    )


def _function_imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(_tree(path)):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
    return names


def _kernel_names_used(path: Path) -> set[tuple[str, str]]:
    """(kernels module, name) of every name *path* takes from netdam.kernels.*."""
    tree = _tree(path)
    used: set[tuple[str, str]] = set()
    modules: dict[str, str] = {}
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.ImportFrom)
            and node.module
            and node.module.startswith("netdam.kernels.")
        ):
            used |= {(node.module, a.name) for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module == "netdam.kernels":
            modules |= {a.asname or a.name: f"netdam.kernels.{a.name}" for a in node.names}
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id in modules
        ):
            used.add((modules[node.value.id], node.attr))
    return used


def private_reaches(tree: ast.Module, ours: set[str]) -> list[str]:
    """Names *tree* takes from another module of ours that its owner keeps private (``_x``, not
    dunders): ``from m import _x`` and ``m._x`` for a module m imported as a name."""
    found = []
    modules: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for a in node.names:
                if f"{node.module}.{a.name}" in ours:
                    modules.add(a.asname or a.name)  # a module imported from its package
                elif a.name.startswith("_") and not a.name.startswith("__") and node.module in ours:
                    found.append(f"from {node.module} import {a.name}")
        elif isinstance(node, ast.Import):
            modules |= {a.asname for a in node.names if a.asname and a.name in ours}
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id in modules
            and node.attr.startswith("_")
            and not node.attr.startswith("__")
        ):
            found.append(f"{node.value.id}.{node.attr} (line {node.lineno})")
    return found


def test_no_module_reaches_another_modules_private_names() -> None:
    """A ``_private`` name is its module's own; what another module needs is public on purpose
    (tests of a module may reach into it)."""
    ours = set(our_modules())
    found = {}
    for name, path in our_modules().items():
        reaches = private_reaches(_tree(path), ours)
        if reaches:
            found[name] = reaches
    assert not found, found
    probe = ast.parse(
        "from netdam.kernels.wire import _le16\nfrom netdam.kernels import wire\nwire._wr8\n"
    )
    assert private_reaches(probe, ours) == [
        "from netdam.kernels.wire import _le16",
        "wire._wr8 (line 3)",
    ]


def test_python_outside_the_kernels_calls_no_jitted_kernel() -> None:
    """Kernel modules share their jitted helpers by public names (wire.rd32, faults.decide_fate,
    ...) inside netdam/kernels/; everything else reaches the kernels through the wrappers that
    check bounds first (numba does not): no name it uses is a compiled dispatcher."""
    import importlib

    from numba.core.dispatcher import Dispatcher

    found = []
    for path in our_modules().values():
        if "kernels" in path.parts:
            continue
        for module, name in _kernel_names_used(path):
            if isinstance(getattr(importlib.import_module(module), name, None), Dispatcher):
                found.append(f"{path.relative_to(ROOT)}: {module}.{name}")
    assert not found, found


def test_private_kernels_only_through_wrappers() -> None:
    """Python calls kernels through the public wrappers that check what numba does not; only
    netdam/kernels/ itself sees the `_private` jitted functions (tests of a kernel may too)."""
    for path in our_modules().values():
        if "kernels" in path.parts:
            continue
        for node in ast.walk(_tree(path)):
            if (
                isinstance(node, ast.ImportFrom)
                and node.module
                and node.module.startswith("netdam.kernels")
            ):
                private = [
                    a.name for a in node.names if a.name.startswith("_") and not a.name.isupper()
                ]
                assert not private, (path.relative_to(ROOT), node.module, private)
        kernel_aliases = {
            a.asname or a.name
            for node in ast.walk(_tree(path))
            if isinstance(node, ast.ImportFrom) and node.module in ("netdam.kernels",)
            for a in node.names
        }
        for node in ast.walk(_tree(path)):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id in kernel_aliases
            ):
                name = node.attr
                assert not (name.startswith("_") and not name[1:].isupper()), (
                    path.relative_to(ROOT),
                    f"{node.value.id}.{name}",
                )


# ---------------------------------------------------------------- datagram offsets have names

#: Variables that hold datagram bytes, as the code outside protocol/ names them: a request (b),
#: a reply or outgoing datagram (t, d, header), a batch's buffer (buf, rx, rx_buf, tx_buf), a
#: header template, and the Python side's bytes (data, datagram).
DATAGRAM_NAMES = {
    "b",
    "t",
    "d",
    "buf",
    "rx",
    "rx_buf",
    "tx_buf",
    "header",
    "template",
    "data",
    "datagram",
}
#: Byte readers and writers whose second argument is an offset into a datagram.
OFFSET_CALLS = re.compile(r"(?:^|_)(rd|wr|le|put_le)\d+$")
#: The byte primitives themselves (netdam/kernels/wire.py): `b[o + 1]` there is the second byte
#: of whatever field `o` names, not a datagram offset.
PRIMITIVES = {
    "rd16",
    "rd32",
    "rd64",
    "_wr8",
    "wr16",
    "wr32",
    "wr64",
    "le16",
    "le32",
    "le64",
    "put_le32",
    "put_le64",
}


def _literal_terms(node: ast.AST | None) -> list[int]:
    """Integer literals added or subtracted at the top of an index expression: ``b[28]``,
    ``b[o + 6]``, ``b[p + 8 + 2 * k]`` (8); not ``b[2 * k]`` nor ``b[H_SEQ]``. A literal 0 is
    let through: ``x[0]`` of a datagram is also no offset when 0 is a loop's start, and every
    field at 0 (version, a payload's first field) is read through its name anyway."""
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return [node.value] if node.value != 0 else []
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Sub)):
        return _literal_terms(node.left) + _literal_terms(node.right)
    if isinstance(node, ast.Slice):
        return _literal_terms(node.lower) + _literal_terms(node.upper)
    return []


def literal_datagram_offsets(source: str | ast.Module) -> list[tuple[int, str]]:
    """(line, code) of every integer-literal offset into a datagram in *source* (text or tree)."""
    tree = ast.parse(source) if isinstance(source, str) else source
    exempt: set[int] = set()
    for fn in ast.walk(tree):
        if isinstance(fn, ast.FunctionDef) and fn.name in PRIMITIVES:
            exempt |= {n.lineno for n in ast.walk(fn) if hasattr(n, "lineno")}
    hits = []
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Subscript)
            and isinstance(node.value, ast.Name)
            and node.value.id in DATAGRAM_NAMES
        ):
            offset: ast.AST | None = node.slice
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and OFFSET_CALLS.search(node.func.id)
            and len(node.args) >= 2
        ):
            offset = node.args[1]
        else:
            continue
        if node.lineno not in exempt and _literal_terms(offset):
            hits.append((node.lineno, ast.unparse(node)))
    return hits


def test_datagram_offsets_have_names() -> None:
    """A field is read and written by its name from protocol/layout.py (H_SEQ, SEG_PORT,
    CPL_START_NS ...), never by a number: a field that moves is one line of layout.py."""
    found = {}
    for path in our_modules().values():
        rel = path.relative_to(ROOT).as_posix()
        if rel.startswith(("protocol/", "netdam/tools/fuzz/")):
            continue  # the fuzzer corrupts single bytes of fields on purpose (its offsets are layout's)
        hits = literal_datagram_offsets(_tree(path))
        if hits:
            found[rel] = hits
    assert not found, found


# ---------------------------------------------------------------- kernels: hints outside the jit

#: Decorators whose functions numba compiles (typed by numba, not by annotations).
JIT_DECORATORS = {
    "njit",
    "jit",
    "intrinsic",
    "overload",
    "overload_method",
    "register_jitable",
    "cfunc",
    "vectorize",
    "guvectorize",
    "generated_jit",
}


def _decorator_names(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> set[str]:
    names = set()
    for d in fn.decorator_list:
        target = d.func if isinstance(d, ast.Call) else d
        names.add(target.attr if isinstance(target, ast.Attribute) else getattr(target, "id", ""))
    return names


def unannotated_outside_jit(tree: ast.Module) -> list[str]:
    """Functions of *tree* not compiled by numba (nor nested in one) that lack a hint."""
    found: list[str] = []

    def visit(node: ast.AST, in_jit: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                jit = in_jit or bool(_decorator_names(child) & JIT_DECORATORS)
                args = child.args.posonlyargs + child.args.args + child.args.kwonlyargs
                missing = [
                    a.arg for a in args if a.annotation is None and a.arg not in ("self", "cls")
                ]
                if not jit and (missing or child.returns is None):
                    found.append(f"{child.name} (line {child.lineno})")
                visit(child, jit)
            else:
                visit(child, in_jit)

    visit(tree, False)
    return found


def test_kernels_python_is_annotated() -> None:
    """mypy leaves netdam/kernels/ untyped-def checks off for the jitted kernels (numba types
    them; pyproject.toml's override), so no kernel carries a `type: ignore` for it; the Python
    around them (wrappers, codegen helpers) keeps its hints, checked here."""
    found = {}
    for path in sorted((ROOT / "netdam" / "kernels").glob("*.py")):
        missing = unannotated_outside_jit(_tree(path))
        if missing:
            found[path.name] = missing
    assert not found, found
    assert unannotated_outside_jit(ast.parse("def f(x):\n    return x\n")) == ["f (line 1)"]
    assert unannotated_outside_jit(ast.parse("@njit\ndef f(x):\n    return x\n")) == []


def arrays_reshaped_in_place(tree: ast.Module) -> list[int]:
    """Lines that assign an object's ``shape`` or ``dtype`` (numpy reinterprets an array in
    place), other than ``self``'s own attributes."""
    return [
        node.lineno
        for node in ast.walk(tree)
        if isinstance(node, ast.Assign | ast.AugAssign | ast.AnnAssign)
        for target in (node.targets if isinstance(node, ast.Assign) else [node.target])
        if isinstance(target, ast.Attribute)
        and target.attr in ("shape", "dtype")
        and not (isinstance(target.value, ast.Name) and target.value.id == "self")
    ]


def test_no_array_changes_its_shape_or_dtype_in_place() -> None:
    """The serve loop calls its compiled entry point directly while its arguments are the
    arrays it typed once (netdam.kernels.serve.NicLoop): an array reshaped or retyped in
    place would be read with the types it had. So none is."""
    found = {
        name: lines
        for name, path in our_modules().items()
        if (lines := arrays_reshaped_in_place(_tree(path)))
    }
    assert not found, found
    probe = ast.parse("a.shape = (2, 3)\nself.dtype = 4\nb.dtype: int = 2\nc.size = 1\n")
    assert arrays_reshaped_in_place(probe) == [1, 3]
