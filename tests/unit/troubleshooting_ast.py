"""The text of a message the code builds, read from its syntax tree (``troubleshooting_code``).

A message is text and holes (values known at run time only). Read into it: string literals,
f-strings, ``+`` and ``%`` of them; module-level string constants (of the module, or imported
from another package module); and, as alternatives (:class:`Alt`), what a name or call of the
same module may hold: each value a function assigns a local name (both branches of an
``if``-expression or an ``or``, the values of a module-level dict it looks up, the items of a
literal tuple a ``for`` loop runs over, the return values of a function it calls), for a
parameter the arguments of each call of the function in the module, for a call of a module
function the values it returns, its parameters bound. The alternatives of different names
combine freely (a wider set of messages than the code makes, never a narrower one). A
``SchedulingError`` template's ``{field}`` is the keyword value the call gives it, a hole for a
parameter's name; everything else is a hole.
"""

import ast
import functools
import itertools
import math
import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Dict, FrozenSet, Iterator, List, Mapping, Optional, Tuple, Union

PACKAGE = Path(__file__).resolve().parents[2] / "megatron_dcp"
HOLE = None
FORMAT_FIELD = re.compile(r"\{[^{}]*\}")
MAX_DEPTH = 6  # names, calls and call sites read inside one another
MAX_ALTERNATIVES = 64  # a message with more combinations keeps its alternatives as holes
FUNCTIONS = (ast.FunctionDef, ast.AsyncFunctionDef)
SEQUENCES = (ast.Tuple, ast.List)


class Alt(tuple):
    """What a name or call may hold: a tuple of messages (lists of pieces)."""


Piece = Union[str, None, Alt]  # text, a HOLE, or alternatives
Message = List[Piece]
Options = Optional[List[Message]]  # the messages a value may be; None: unknown


@dataclass(frozen=True)
class Module:
    """A module's tree, its string constants, its functions and message-making exception
    classes by name, every call by the name it calls and the function each call is in."""

    tree: ast.Module
    known: Dict[str, str]
    functions: Dict[str, ast.AST]
    classes: Dict[str, Tuple[ast.FunctionDef, ast.expr]]
    calls: Dict[str, List[ast.Call]]
    caller: Dict[int, Optional[ast.AST]]


@dataclass(frozen=True)
class Scope:
    """Where a value is read: the module, the function, the parameters bound by a call."""

    module: Module
    function: Optional[ast.AST] = None
    env: Mapping[str, Options] = field(default_factory=dict)
    depth: int = 0

    def deeper(self, **changes: object) -> "Scope":
        return replace(self, depth=self.depth + 1, **changes)


def module_constants(tree: ast.Module) -> Dict[str, str]:
    """The module-level ``NAME = "text"`` assignments of ``tree``."""
    constants = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant):
            if isinstance(node.value.value, str):
                for target in node.targets:
                    if isinstance(target, ast.Name):
                        constants[target.id] = node.value.value
    return constants


@functools.lru_cache(maxsize=None)
def constants_of(path: Path) -> Dict[str, str]:
    return module_constants(ast.parse(path.read_text()))


def known_constants(tree: ast.Module) -> Dict[str, str]:
    """The module's string constants and those it imports from other package modules."""
    known: Dict[str, str] = {}
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("megatron_dcp."):
            path = PACKAGE.joinpath(*node.module.split(".")[1:]).with_suffix(".py")
            if not path.exists():
                continue
            theirs = constants_of(path)
            for alias in node.names:
                if alias.name in theirs:
                    known[alias.asname or alias.name] = theirs[alias.name]
    known.update(module_constants(tree))
    return known


def call_name(call: ast.Call) -> str:
    return getattr(call.func, "id", getattr(call.func, "attr", ""))


def in_functions(tree: ast.AST) -> Iterator[Tuple[ast.AST, Optional[ast.AST]]]:
    """Every node of ``tree`` and the innermost function it is in (None: module level)."""

    def visit(node: ast.AST, function: Optional[ast.AST]) -> Iterator[Tuple[ast.AST, object]]:
        for child in ast.iter_child_nodes(node):
            inner = child if isinstance(child, FUNCTIONS) else function
            yield child, inner
            yield from visit(child, inner)

    return visit(tree, None)  # type: ignore[return-value]


def super_message(cls: ast.ClassDef) -> Optional[Tuple[ast.FunctionDef, ast.expr]]:
    """A class's ``__init__`` and the message it hands ``super().__init__``."""
    for init in cls.body:
        if isinstance(init, ast.FunctionDef) and init.name == "__init__":
            for node in ast.walk(init):
                if isinstance(node, ast.Call) and call_name(node) == "__init__" and node.args:
                    return init, node.args[0]
    return None


def read_module(tree: ast.Module) -> Scope:
    """The module scope of ``tree``."""
    functions: Dict[str, ast.AST] = {}
    classes = {}
    calls: Dict[str, List[ast.Call]] = {}
    caller: Dict[int, Optional[ast.AST]] = {}
    for node, function in in_functions(tree):
        if isinstance(node, FUNCTIONS):
            functions[node.name] = node
        elif isinstance(node, ast.ClassDef) and super_message(node) is not None:
            classes[node.name] = super_message(node)
        elif isinstance(node, ast.Call):
            calls.setdefault(call_name(node), []).append(node)
            caller[id(node)] = function
    return Scope(Module(tree, known_constants(tree), functions, classes, calls, caller))


def pieces(node: ast.AST, scope: Scope) -> Optional[Message]:
    """The message ``node`` builds; None when it is no text this reading can tell."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, ast.JoinedStr):
        return joined(node, scope)
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Mod)):
        left = pieces(node.left, scope)
        if isinstance(node.op, ast.Mod):
            return None if left is None else [HOLE if p is None else p for p in left]
        right = pieces(node.right, scope)
        return None if left is None or right is None else left + right
    if isinstance(node, (ast.Constant, ast.BinOp)):
        return None
    options = value_options(node, scope)
    return None if options is None else alternatives(options)


def alternatives(options: List[Message]) -> Message:
    """One message's pieces, or several as alternatives."""
    return list(options[0]) if len(options) == 1 else [Alt(options)]


def joined(node: ast.JoinedStr, scope: Scope) -> Message:
    out: Message = []
    for value in node.values:
        if isinstance(value, ast.Constant):
            out.append(str(value.value))
            continue
        plain = value.format_spec is None and value.conversion in (-1, ord("r"))
        options = value_options(value.value, scope) if plain else None
        if options is not None and value.conversion == ord("r"):
            options = [quoted(option) for option in options]
        out.extend([HOLE] if options is None else alternatives(options))
    return out


def quoted(message: Message) -> Message:
    """``{value!r}`` of one of a value's messages: its text as Python writes it."""
    if len(message) == 1 and isinstance(message[0], str):
        return [repr(message[0])]
    return [HOLE]


def value_options(node: ast.AST, scope: Scope) -> Options:
    """The messages ``node`` may be (an unknown alternative a hole); None: unknown."""
    if isinstance(node, ast.Constant):
        return [[node.value]] if isinstance(node.value, str) else None
    if isinstance(node, (ast.JoinedStr, ast.BinOp)):
        found = pieces(node, scope)
        return None if found is None else [found]
    if scope.depth >= MAX_DEPTH:
        return None
    if isinstance(node, ast.Name):
        return name_options(node.id, scope.deeper())
    if isinstance(node, ast.Call) and call_name(node) in scope.module.functions:
        return returned_options(node, scope.deeper())
    parts = branches(node, scope.module.tree)
    if parts is None:
        return None
    return merged(value_options(part, scope.deeper()) for part in parts)


def merged(options: "Iterator[Options]") -> Options:
    """The alternatives of several values together (an unknown one a hole)."""
    found = list(options)
    if all(option is None for option in found):
        return None
    return [message for option in found for message in (option or [[HOLE]])]


def branches(node: ast.AST, tree: ast.Module) -> Optional[List[ast.AST]]:
    """The values an ``if``-expression, an ``or`` or a dict lookup may take."""
    if isinstance(node, ast.IfExp):
        return [node.body, node.orelse]
    if isinstance(node, ast.BoolOp):
        return list(node.values)
    return looked_up(node, tree)


def looked_up(value: ast.AST, tree: ast.Module) -> Optional[List[ast.AST]]:
    """The values of the module-level dict ``value`` reads (``TABLE[k]``, ``TABLE.get(k)``,
    with the default of ``get``)."""
    if isinstance(value, ast.Subscript):
        holder, default = value.value, []
    elif isinstance(value, ast.Call) and call_name(value) == "get" and value.args:
        holder, default = getattr(value.func, "value", None), list(value.args[1:])
    else:
        return None
    for node in tree.body:
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and isinstance(node.value, ast.Dict):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names = {getattr(target, "id", None) for target in targets}
            if isinstance(holder, ast.Name) and holder.id in names:
                return list(node.value.values) + default
    return None


def parameters(function: ast.AST) -> List[str]:
    """A function's positional parameters, ``self`` and ``cls`` left out."""
    args = function.args  # type: ignore[attr-defined]
    return [a.arg for a in [*args.posonlyargs, *args.args] if a.arg not in ("self", "cls")]


def bound_to(function: ast.AST, call: ast.Call, scope: Scope) -> Dict[str, Options]:
    """The parameters of ``function`` as ``call`` (read in ``scope``) binds them."""
    env = {name: value_options(arg, scope) for name, arg in zip(parameters(function), call.args)}
    env.update({k.arg: value_options(k.value, scope) for k in call.keywords if k.arg})
    return env


def returns(function: ast.AST) -> List[ast.expr]:
    return [n.value for n in ast.walk(function) if isinstance(n, ast.Return) and n.value]


def returned_options(call: ast.Call, scope: Scope) -> Options:
    """What a call of a module function may return, its parameters bound to the arguments (an
    exception it returns: that exception's message)."""
    function = scope.module.functions[call_name(call)]
    inner = scope.deeper(function=function, env=bound_to(function, call, scope))
    found = []
    for value in returns(function):
        if isinstance(value, ast.Call) and call_name(value)[:1].isupper():
            message = message_of(value, inner)
            found.append(None if message is None else [message])
        else:
            found.append(value_options(value, inner))
    return merged(iter(found))


def name_options(name: str, scope: Scope) -> Options:
    """What a name may hold: a constant, a bound parameter, the values the function assigns
    it, or for a parameter the arguments of the function's calls in the module."""
    if name in scope.module.known:
        return [[scope.module.known[name]]]
    if name in scope.env:
        return scope.env[name]
    if scope.function is None:
        return None
    bound = list(bound_values(name, scope))
    if bound:
        return merged(value_options(v, s) if v is not None else None for v, s in bound)
    if name in parameters(scope.function):
        return call_site_options(name, scope)
    return None


def call_site_options(name: str, scope: Scope) -> Options:
    """The arguments the module's calls of the function pass its parameter ``name``."""
    function = scope.function
    index = parameters(function).index(name)
    found = []
    for call in scope.module.calls.get(function.name, []):  # type: ignore[union-attr]
        caller = scope.deeper(function=scope.module.caller[id(call)], env={})
        keyword = [k.value for k in call.keywords if k.arg == name]
        arg = keyword[0] if keyword else (call.args[index] if index < len(call.args) else None)
        found.append(None if arg is None else value_options(arg, caller))
    return merged(iter(found)) if found else None


Bound = Tuple[Optional[ast.AST], Scope]  # a value and the scope to read it in (None: unknown)


def bound_values(name: str, scope: Scope) -> Iterator[Bound]:
    """Every value the function binds ``name`` to: assignments, and ``for`` loops."""
    for node, targets in binders(scope.function):
        if name not in targets:
            continue
        if isinstance(node, ast.For):
            items = literal_items(node.iter, scope)
            for item in items if items is not None else [None]:
                yield from bind(name, node.target, item, scope)
        else:
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                yield from bind(name, target, node.value, scope)


@functools.lru_cache(maxsize=None)
def binders(holder: ast.AST) -> Tuple[Tuple[ast.AST, FrozenSet[str]], ...]:
    """The assignments and ``for`` loops of a function (or module), each with the names it
    binds."""
    found = []
    for node in ast.walk(holder):
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AnnAssign, ast.For)) and getattr(node, "value", True):
            targets = [node.target]
        else:
            continue
        names = {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
        found.append((node, frozenset(names)))
    return tuple(found)


def bind(name: str, target: ast.AST, value: Optional[ast.AST], scope: Scope) -> Iterator[Bound]:
    """What assigning ``value`` to ``target`` binds ``name`` to; a tuple unpacked from a call
    of a module function: the items of each tuple it returns."""
    if isinstance(target, ast.Name):
        if target.id == name:
            yield value, scope
        return
    if not isinstance(target, (ast.Tuple, ast.List)):
        return
    if isinstance(value, ast.Call) and call_name(value) in scope.module.functions:
        function = scope.module.functions[call_name(value)]
        if scope.depth < MAX_DEPTH:
            inner = scope.deeper(function=function, env=bound_to(function, value, scope))
            for returned in returns(function):
                yield from bind(name, target, returned, inner)
            return
    items = value.elts if isinstance(value, (ast.Tuple, ast.List)) else None
    for index, element in enumerate(target.elts):
        same = items is not None and len(items) == len(target.elts)
        yield from bind(name, element, items[index] if same else None, scope)


def literal_items(node: ast.AST, scope: Scope) -> Optional[List[ast.AST]]:
    """The items of a literal tuple or list, or of a name assigned one (in the function or at
    module level); None for anything else."""
    if isinstance(node, SEQUENCES):
        return list(node.elts)
    if not isinstance(node, ast.Name):
        return None
    local = [statement for statement, names in binders(scope.function) if node.id in names]
    for statement in [*local, *scope.module.tree.body]:
        if isinstance(statement, ast.Assign) and isinstance(statement.value, SEQUENCES):
            if any(getattr(t, "id", None) == node.id for t in statement.targets):
                return list(statement.value.elts)
    return None


def message_of(call: ast.Call, scope: Scope) -> Optional[Message]:
    """The message a call carries: what a module function returns or an exception class of
    the module makes of it, else (another exception class, ``parser.error``,
    ``reasons.append``, ``print``) its first positional argument that is text."""
    name = call_name(call)
    if name in scope.module.classes and scope.depth < MAX_DEPTH:
        init, body = scope.module.classes[name]
        return pieces(body, scope.deeper(function=init, env=bound_to(init, call, scope)))
    if name in scope.module.functions and scope.depth < MAX_DEPTH:
        options = returned_options(call, scope.deeper())
        return None if options is None else alternatives(options)
    if not (name[:1].isupper() or name in ("error", "append", "print")):
        return None  # a function of another module: what it makes is not read
    for argument in call.args:
        found = pieces(argument, scope)
        if found is not None:
            return templated(found, call, scope) if name == "SchedulingError" else found
    return None


def templated(message: Message, call: ast.Call, scope: Scope) -> Message:
    """A SchedulingError's template: each ``{field}`` the value the call gives it as a keyword
    (a hole for a parameter's name, filled from a wording, or a value this reading cannot
    tell)."""
    values = {k.arg: k.value for k in call.keywords if k.arg}
    out: Message = []
    for piece in message:
        if not isinstance(piece, str):
            out.append(piece if not isinstance(piece, Alt) else HOLE)
            continue
        start = 0
        for found in FORMAT_FIELD.finditer(piece):
            out.append(piece[start : found.start()])
            start = found.end()
            name, _, conversion = found.group(0)[1:-1].partition("!")
            known = value_options(values[name], scope) if name in values else None
            if known is not None and conversion == "r":
                known = [quoted(option) for option in known]
            out.extend([HOLE] if known is None or ":" in name else alternatives(known))
        out.append(piece[start:])
    return out


def raised_class(call: ast.Call, scope: Scope, depth: int = 0) -> str:
    """What ``call`` raises: its class, or the class a module function returns."""
    function = scope.module.functions.get(call_name(call))
    if function is not None and depth < MAX_DEPTH:
        for value in returns(function):
            if isinstance(value, ast.Call):
                return raised_class(value, scope, depth + 1)
    return call_name(call)


def holes_for_alternatives(message: Message) -> List[Optional[str]]:
    """The message with each set of alternatives a hole."""
    return [HOLE if isinstance(piece, Alt) else piece for piece in message]


def expanded(message: Message) -> List[List[Optional[str]]]:
    """Every message the alternatives make; past :data:`MAX_ALTERNATIVES` combinations, the
    alternatives with the most options are holes instead."""
    options = [
        [option for alternative in piece for option in expanded(alternative)]
        if isinstance(piece, Alt)
        else [[piece]]
        for piece in message
    ]
    while math.prod(len(choices) for choices in options) > MAX_ALTERNATIVES:
        widest = max(range(len(options)), key=lambda index: len(options[index]))
        options[widest] = [[HOLE]]
    return [sum(combination, []) for combination in itertools.product(*options)]
