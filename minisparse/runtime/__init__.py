"""The compiled decode step: ``decoder`` (the ``Decoder`` that runs each block half in C or torch),
``lowering`` (how each module becomes a C struct, one registry per role), ``step`` (the C
file and its library) and ``generate`` (the generation loop, on the compiled step where it can)."""

__all__: list[str] = []
