"""What several commands share: the options that name the model and the device."""

from __future__ import annotations

import argparse

__all__ = ["add_model_arguments"]


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        default="smollm2-135m",
        help="short name, local directory, .gguf file or Hugging Face id",
    )
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda if present)")
