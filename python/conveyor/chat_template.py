"""Chat templates rendered safely: jinja2's immutable sandbox with every operator,
string method and filter that could build a huge value bounded, a deadline on
the render and a cap on its output. A template that does not compile is a
ModelFormatError; one that fails to render, a ValueError. conveyor.template_pool
runs this in capped worker processes."""
from __future__ import annotations

import functools
import re

from ._core import ModelFormatError


# The largest value (characters, items, or bits of an integer / 8) a chat template's
# operator or string method may build: far above what real templates make (about the
# messages' size), far below what would exhaust memory in one C call.
CHAT_TEMPLATE_MAX_VALUE = 1 << 24
_PERCENT_SPEC = re.compile(r"%[-+ #0]*(\*|\d+)?(?:\.(\*|\d+))?")
_WIDTH_METHODS = {"ljust", "rjust", "center", "zfill"}


def _too_big(what: str, size) -> ValueError:
    return ValueError(f"chat template: {what} would make a value of {size} items, over the "
                      f"limit of {CHAT_TEMPLATE_MAX_VALUE}")


def _check_binop(op: str, left, right) -> None:
    """Refuses `seq * n`, `a ** b` and `'%Nd' % x` that would build a huge value."""
    seq = (str, bytes, list, tuple)
    if op == "*":
        for a, b in ((left, right), (right, left)):
            if isinstance(a, seq) and isinstance(b, int) and len(a) * max(b, 0) > CHAT_TEMPLATE_MAX_VALUE:
                raise _too_big("'*'", len(a) * b)
    elif op == "**" and isinstance(left, int) and isinstance(right, int) and abs(left) > 1 and right > 0:
        bits = right * abs(left).bit_length()
        if bits > 8 * CHAT_TEMPLATE_MAX_VALUE // 64:  # a 256 KiB integer is already absurd here
            raise _too_big("'**'", bits // 8)
    elif op == "%" and isinstance(left, str):
        for m in _PERCENT_SPEC.finditer(left):
            for n in m.groups():
                if n == "*" or (n is not None and int(n) > CHAT_TEMPLATE_MAX_VALUE):
                    raise ValueError("chat template: a '%' format width or precision that is '*' or over "
                                     f"{CHAT_TEMPLATE_MAX_VALUE}")


def _check_call(obj, args) -> None:
    """Refuses str methods whose width or replacement would build a huge string."""
    name = getattr(obj, "__name__", None)
    owner = getattr(obj, "__self__", None)
    if not isinstance(owner, str):
        return
    if name in _WIDTH_METHODS and args and isinstance(args[0], int) and args[0] > CHAT_TEMPLATE_MAX_VALUE:
        raise _too_big(f"str.{name}", args[0])
    if name == "expandtabs" and args and isinstance(args[0], int) and args[0] * owner.count("\t") > \
            CHAT_TEMPLATE_MAX_VALUE:
        raise _too_big("str.expandtabs", args[0] * owner.count("\t"))
    if name == "replace" and len(args) >= 2:
        _check_replace(owner, args[0], args[1])


def _check_replace(s, old, new) -> None:
    s, old, new = str(s), str(old), str(new)
    if len(new) > len(old):
        n = s.count(old) if old else len(s) + 1
        if len(s) + n * (len(new) - len(old)) > CHAT_TEMPLATE_MAX_VALUE:
            raise _too_big("replace", len(s) + n * (len(new) - len(old)))


@functools.lru_cache(maxsize=1)
def _template_environment_class():
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class BoundedEnvironment(ImmutableSandboxedEnvironment):
        """The sandbox, with the operators and string methods that turn small literals
        into huge values checked first. Intercepted operators are also not folded at
        compile time: jinja's optimizer would otherwise build `{{ 'ab' * 10**9 }}` while
        compiling, outside every render cap (24 s and 7.6 GB, found by the fuzzer)."""

        intercepted_binops = frozenset(["*", "**", "%"])

        def call_binop(self, context, operator, left, right):
            _check_binop(operator, left, right)
            return super().call_binop(context, operator, left, right)

        def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 (jinja's signature)
            _check_call(__obj, args)
            return super().call(__context, __obj, *args, **kwargs)

    return BoundedEnvironment


def _bounded_filters(env) -> None:
    """The same checks for the filters that pad or replace (they bypass call())."""
    from jinja2.filters import pass_eval_context

    replace, center, indent = env.filters["replace"], env.filters["center"], env.filters["indent"]

    @pass_eval_context
    def bounded_replace(eval_ctx, s, old, new, count=None):
        if count is None:
            _check_replace(s, old, new)
        return replace(eval_ctx, s, old, new, count)

    def bounded_center(value, width=80):
        if isinstance(width, int) and width > CHAT_TEMPLATE_MAX_VALUE:
            raise _too_big("center", width)
        return center(value, width)

    def bounded_indent(s, width=4, *args, **kwargs):
        w = len(width) if isinstance(width, str) else width
        if isinstance(w, int) and w * (str(s).count("\n") + 1) > CHAT_TEMPLATE_MAX_VALUE:
            raise _too_big("indent", w * (str(s).count("\n") + 1))
        return indent(s, width, *args, **kwargs)

    env.filters.update(replace=bounded_replace, center=bounded_center, indent=bounded_indent)


def check_chat_template(source: str) -> None:
    """ModelFormatError (a ValueError) when the template does not compile."""
    _compile_template(source)


@functools.lru_cache(maxsize=16)
def _compile_template(source: str):
    from jinja2.exceptions import TemplateError

    def raise_exception(message):
        raise ValueError(f"chat template: {message}")

    env = _template_environment_class()(trim_blocks=True, lstrip_blocks=True)
    _bounded_filters(env)
    env.globals["raise_exception"] = raise_exception
    try:
        return env.from_string(source)
    except TemplateError as e:
        raise ModelFormatError(f"the model's chat template is not valid Jinja: {e}") from None
    except (RecursionError, MemoryError, OverflowError) as e:  # nesting past the parser's depth, ...
        raise ModelFormatError(f"the model's chat template cannot be compiled: {type(e).__name__}") from None


# A chat template is code from the model file (or the request) run on every chat
# request: the sandbox keeps it from the host, these caps keep it from the CPU and
# memory. Real templates render a conversation in well under a millisecond, and their
# output is about the size of the messages.
CHAT_TEMPLATE_MAX_SECONDS = 2.0
CHAT_TEMPLATE_MAX_OUTPUT = 1 << 20  # characters beyond the messages' own


def render_chat_template(source: str, messages: list[dict], add_generation_prompt: bool,
                         bos_token: str, eos_token: str) -> str:
    from .deadline import call_with_deadline

    limit = CHAT_TEMPLATE_MAX_OUTPUT + sum(len(m["content"]) for m in messages)
    template = _compile_template(source)  # a template that does not compile: ModelFormatError

    def render():
        parts, size = [], 0
        for piece in template.generate(
                messages=messages, add_generation_prompt=add_generation_prompt, bos_token=bos_token,
                eos_token=eos_token):
            size += len(piece)
            if size > limit:
                raise ValueError(f"chat template output is over {limit} characters")
            parts.append(piece)
        return "".join(parts)

    try:
        return call_with_deadline(CHAT_TEMPLATE_MAX_SECONDS, "rendering the chat template", render)
    except ValueError as e:  # raise_exception() in the template, or the output cap
        raise ValueError(f"chat template failed to render: {e}") from None
    except MemoryError:  # past the renderer's memory cap (conveyor.template_pool)
        raise ValueError("chat template failed to render: it needs more memory than a template may "
                         "use (MemoryError)") from None
    except Exception as e:  # jinja's own errors, and OverflowError, RecursionError, TimeoutError...
        raise ValueError(f"chat template failed to render: {type(e).__name__}: {e}") from None
