"""The course around the library: graded exercises (``exercises``, ``grading`` and the two sets of
cases), the tour and the preparation of the long results (``prepare``)."""

__all__: list[str] = []
