"""What `accelerate estimate-memory` computes for a model directory, offline: the command itself asks
the Hub first (verify_on_hub) and cannot run without it, so this runs the same steps it runs after
that on the local config.json: AutoConfig, AutoModel.from_config under init_empty_weights
(create_empty_model), calculate_maximum_sizes, estimate_training_usage for float32. Prints one JSON
line: total_size and largest_layer (bytes), training (the "Training using Adam" column: the
largest of its figures), parameters, and buffer_bytes (total_size counts the buffers too: the
rotary embedding's inverse frequencies)."""
import json
import sys

from accelerate import init_empty_weights
from accelerate.commands.estimate import estimate_training_usage
from accelerate.utils import calculate_maximum_sizes
from transformers import AutoConfig, AutoModel


def main():
    config = AutoConfig.from_pretrained(sys.argv[1])
    with init_empty_weights():
        model = AutoModel.from_config(config)
    total_size, largest_layer = calculate_maximum_sizes(model)
    usage = estimate_training_usage(total_size, "float32")
    print(json.dumps({"total_size": int(total_size), "largest_layer": int(largest_layer[0]),
                      "training": int(max(usage.values())),
                      "parameters": sum(p.numel() for p in model.parameters()),
                      "buffer_bytes": sum(b.numel() * b.element_size() for b in model.buffers())}))


if __name__ == "__main__":
    main()
