"""The compiled decode step: ``decoder`` (the ``Decoder`` that runs each block half in C or torch),
``lowering`` (how each module becomes a C struct, one registry per role) and ``step`` (the C
file and its library)."""

__all__: list[str] = []
