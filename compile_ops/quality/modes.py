"""The report's modes: names on the command line, each a set of :func:`compile_ops.patch` options.

A mode is ``exact`` (the unpatched model: the reference), or one or more of
:data:`MODE_PARTS` joined with ``+`` (``fp8+int8_fp8``). Parsing checks the
names only; whether a model takes the options is :func:`compile_ops.patch`'s
call, made per mode by the runner.
"""

import dataclasses
from typing import Optional

#: The reference mode: the pipeline as loaded, not patched.
EXACT = "exact"

#: Each part of a mode and the ``compile_ops.patch`` options it sets; the sparse
#: parts name a configuration class of
#: ``compile_ops.integrations.sparse_attention`` built with its defaults.
MODE_PARTS = {
    "patched": {},
    "fp8": {"precision": "fp8"},
    "int8": {"attention_precision": "int8"},
    "int8_fp8": {"attention_precision": "int8_fp8"},
    "sparse": {"attention": "SlidingTile"},
    "sparse:sliding_tile": {"attention": "SlidingTile"},
    "sparse:radial": {"attention": "Radial"},
    "sparse:topk": {"attention": "TopK"},
}

VALID_MODES = (EXACT, *MODE_PARTS)


@dataclasses.dataclass(frozen=True)
class Mode:
    """One mode of the report.

    Attributes:
        name: as given on the command line (``"fp8+int8_fp8"``).
        options: the ``compile_ops.patch`` keyword options, the sparse class by
            name (built by :meth:`patch_options`); None for ``exact``.
    """

    name: str
    options: Optional[dict]

    @property
    def is_exact(self) -> bool:
        return self.options is None

    @property
    def file_name(self) -> str:
        """The name as it goes into file names (no ``:``)."""
        return self.name.replace(":", "-")

    def patch_options(self) -> dict:
        """The keyword options for ``compile_ops.patch``, sparse configuration built."""
        from compile_ops.integrations import sparse_attention

        options = dict(self.options or {})
        if "attention" in options:
            options["attention"] = getattr(sparse_attention, options["attention"])()
        return options

    def describe(self) -> str:
        """The patch call this mode makes, as text for the page."""
        if self.is_exact:
            return "no patch (reference)"
        arguments = [f"{k}={v}()" if k == "attention" else f"{k}={v!r}" for k, v in self.options.items()]
        return "compile_ops.patch(transformer" + "".join(", " + a for a in arguments) + ")"


def parse_mode(text: str, argument: str = "--modes") -> Mode:
    """The :class:`Mode` named ``text`` (``"fp8+int8_fp8"``); an unknown or
    conflicting part raises a ValueError naming ``argument``, the part and the valid names."""
    name = text.strip()
    if name == EXACT:
        return Mode(EXACT, None)
    parts = name.split("+")
    options = {}
    for part in parts:
        if part not in MODE_PARTS:
            raise ValueError(
                f"{argument}: unknown mode {part!r}"
                + (f" in {name!r}" if part != name else "")
                + f"; valid modes: {', '.join(VALID_MODES)} (join parts with '+')"
            )
        for key, value in MODE_PARTS[part].items():
            if key in options and options[key] != value:
                raise ValueError(f"{argument}: mode {name!r} sets {key} twice ({options[key]!r} and {value!r})")
            options[key] = value
    return Mode(name, options)


def parse_modes(text: str, argument: str = "--modes") -> list:
    """The modes of a comma-separated list, ``exact`` first (added when missing:
    it is every other mode's reference); duplicates raise a ValueError naming ``argument``."""
    names = [part for part in text.split(",") if part.strip()]
    if not names:
        raise ValueError(f"{argument}: no mode given; valid modes: {', '.join(VALID_MODES)}")
    modes = [parse_mode(n, argument) for n in names]
    seen = set()
    for mode in modes:
        if mode.name in seen:
            raise ValueError(f"{argument}: mode {mode.name!r} given twice")
        seen.add(mode.name)
    exact = [m for m in modes if m.is_exact] or [Mode(EXACT, None)]
    return exact + [m for m in modes if not m.is_exact]
