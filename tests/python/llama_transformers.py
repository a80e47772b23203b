"""transformers' LlamaForCausalLM beside fsdp.cpp's Llama (tests/models/llama_transformers_crosscheck_test.cpp).

    llama_transformers.py logits MODEL_DIR INPUTS
        Loads MODEL_DIR (written by fsdp.cpp) with LlamaForCausalLM.from_pretrained, runs it on the
        token ids in INPUTS (safetensors: "input_ids", and "logits", fsdp.cpp's output), and fails
        unless every weight was found and the logits agree within 1e-5 (fp32). Prints max_abs_diff.
    llama_transformers.py make MODEL_DIR TIED KV_HEADS SHARDED DATA SEQ_LEN EVAL_TOKENS
        Creates a random LlamaForCausalLM, saves it with save_pretrained (SHARDED=1: several files and
        model.safetensors.index.json), and prints transformers_loss=<mean next-token cross entropy>
        over the non-overlapping windows of SEQ_LEN + 1 bytes of DATA that train_llama --eval-only reads.
"""
import sys

import torch
from safetensors.torch import load_file
from transformers import LlamaConfig, LlamaForCausalLM


def logits(model_dir, inputs_path):
    inputs = load_file(inputs_path)
    model, info = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32, output_loading_info=True)
    problems = {kind: keys for kind, keys in info.items() if keys}
    if problems:
        raise SystemExit(f"from_pretrained({model_dir}) did not take every weight as is: {problems}")
    model.eval()
    with torch.no_grad():
        theirs = model(input_ids=inputs["input_ids"]).logits
    difference = (theirs - inputs["logits"]).abs().max().item()
    print(f"max_abs_diff={difference:.3e} over logits {tuple(theirs.shape)}; "
          f"rope {model.config.rope_parameters}, rms_norm_eps {model.config.rms_norm_eps}, "
          f"tie_word_embeddings {model.config.tie_word_embeddings}")
    if not difference <= 1e-5:
        raise SystemExit(f"logits differ by {difference:.3e} (> 1e-5)")


def make(model_dir, tied, kv_heads, sharded, data, seq_len, eval_tokens):
    torch.manual_seed(1234)
    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=kv_heads, max_position_embeddings=256,
                         rms_norm_eps=1e-3, rope_parameters={"rope_type": "default", "rope_theta": 777.0},
                         tie_word_embeddings=tied)
    model = LlamaForCausalLM(config)
    with torch.no_grad():  # norms start at one: make them matter
        for name, parameter in model.named_parameters():
            if name.endswith("norm.weight"):
                parameter.uniform_(0.5, 1.5)
    model.eval()
    model.save_pretrained(model_dir, max_shard_size="40KB" if sharded else "5GB")
    tokens = torch.tensor(list(open(data, "rb").read()), dtype=torch.long)
    available = min(eval_tokens, tokens.numel())
    windows = available // (seq_len + 1)
    rows = tokens[: windows * (seq_len + 1)].view(windows, seq_len + 1)
    with torch.no_grad():
        out = model(input_ids=rows[:, :seq_len]).logits
        loss = torch.nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]).double(), rows[:, 1:].reshape(-1))
    print(f"transformers_loss={loss.item():.8f} over {windows} windows")


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "logits":
        logits(sys.argv[2], sys.argv[3])
    elif len(sys.argv) == 9 and sys.argv[1] == "make":
        make(sys.argv[2], sys.argv[3] == "1", int(sys.argv[4]), sys.argv[5] == "1", sys.argv[6], int(sys.argv[7]),
             int(sys.argv[8]))
    else:
        raise SystemExit(__doc__)
