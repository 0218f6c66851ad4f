"""Layer selectors: the one reader of the layers a spec entry or an option names (``all``, ``N``,
``A-B``, ``A,B,...``), for the locality spec and every command-line option that takes layers
(``cli_types`` wraps it for argparse). Pure Python: no torch, no fairseq."""

import re
from typing import List, Optional

LAYER_SELECTOR_SYNTAX = "N, 'A-B' (A <= B), 'A,B,...' or 'all'"
_LAYER_PIECE = re.compile(r"(\d+)(?:\s*-\s*(\d+))?")


def layer_selection(selector, num_layers: Optional[int] = None) -> Optional[List[int]]:
    """The layers (0-based) a layer selector names, in the order given: ``all``, ``N``, ``A-B``
    (A to B, both included) or a comma-separated list of these.

    A selector that selects no layer (empty, a reversed range such as ``2-0``) is refused with a
    ValueError: read as ``range(2, 1)`` it would leave those layers global without a word. With
    ``num_layers`` every layer must exist; without it (a value checked before the model's depth
    is known) numbers are not bounded and ``all`` gives None."""
    text = "" if selector is None else str(selector).strip()
    if not text:
        raise ValueError(
            f"layer selector {selector!r} selects no layer; give {LAYER_SELECTOR_SYNTAX}"
        )
    if text == "all":
        layers = None if num_layers is None else list(range(num_layers))
    else:
        layers = []
        for piece in text.split(","):
            match = _LAYER_PIECE.fullmatch(piece.strip())
            if match is None:
                raise ValueError(f"layer selector {text!r} is not {LAYER_SELECTOR_SYNTAX}")
            first, last = int(match[1]), int(match[2] or match[1])
            if first > last:
                where = "" if piece == text else f": the range {piece.strip()!r}"
                raise ValueError(
                    f"layer selector {text!r}{where} runs backwards and selects no layer; "
                    f"write '{last}-{first}'"
                )
            layers.extend(range(first, last + 1))
    if num_layers is not None:
        if not layers:
            raise ValueError(f"layer selector {text!r} selects no layer: the model has none")
        for layer in layers:
            if layer >= num_layers:
                raise ValueError(
                    f"layer {layer} does not exist; the model has {num_layers} layers "
                    f"(numbered 0-{num_layers - 1})"
                )
    return layers
