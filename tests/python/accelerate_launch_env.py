"""The FSDP variables `accelerate launch --config_file FILE` exports, for
tests/config/accelerate_config_side_by_side_test.cpp.

    accelerate_launch_env.py OUTPUT FILE...

Each FILE goes through Accelerate's own launch path (launch_command_parser, _validate_launch_command,
prepare_multi_gpu_env) without starting anything, and OUTPUT receives {FILE: {variable: value}} with
every FSDP_* variable and ACCELERATE_USE_FSDP / ACCELERATE_MIXED_PRECISION.
"""
import json
import sys

from accelerate.commands.launch import _validate_launch_command, launch_command_parser
from accelerate.utils.launch import prepare_multi_gpu_env


def exported(path):
    args = launch_command_parser().parse_args(["--config_file", path, "train.py"])
    args, _, _ = _validate_launch_command(args)
    environment = prepare_multi_gpu_env(args)
    keep = ("ACCELERATE_USE_FSDP", "ACCELERATE_MIXED_PRECISION")
    return {name: value for name, value in environment.items() if name.startswith("FSDP_") or name in keep}


def main(output, paths):
    json.dump({path: exported(path) for path in paths}, open(output, "w"), indent=1, sort_keys=True)


if __name__ == "__main__":
    if len(sys.argv) < 3:
        raise SystemExit(__doc__)
    main(sys.argv[1], sys.argv[2:])
