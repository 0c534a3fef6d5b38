"""What the scripts share: the machine a run measured on, named in one line, and a command line
read from a config dataclass whose fields carry their default and help (`specexec.option`)."""

import argparse
import os
import platform
import typing
from dataclasses import fields

import torch


def cpu_name():
    """The processor's model name (Linux), else what `platform` knows."""
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if "model name" in line)
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def machine():
    """The processor, its cores, torch's threads, the GPU, torch's version and the load now."""
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU"
    return (
        f"{cpu_name()}, {os.cpu_count()} cores, {torch.get_num_threads()} torch threads, {gpu}; "
        f"torch {torch.__version__}; load average {os.getloadavg()[0]:.1f}"
    )


def command_line(config, description):
    """A parser with one flag per field of the dataclass `config`: its default, its help and
    its type (of `X | None`, X); a bool field is a switch; metadata "choices" lists the values."""
    parser = argparse.ArgumentParser(
        description=description, formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    for f in fields(config):
        flag, text = "--" + f.name.replace("_", "-"), f.metadata["help"]
        if f.type is bool:
            parser.add_argument(flag, action="store_true", help=text)
            continue
        kind = next(t for t in typing.get_args(f.type) or [f.type] if t is not type(None))
        choices = f.metadata.get("choices")
        parser.add_argument(flag, type=kind, default=f.default, choices=choices, help=text)
    return parser
