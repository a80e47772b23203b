// train_llama: train a Llama-architecture byte-level language model with FSDP, save checkpoints that
// resume exactly, and leave a Hugging Face directory (model.safetensors + config.json) behind.
//
//   fsdp launch --nproc-per-node 2 -- build/bin/train_llama --output-dir runs/llama
//   build/bin/train_llama --eval-only --init-from runs/llama/final --data FILE --seq-len 128 --eval-tokens 65536
//
// FSDP settings come from the plugin (FSDP_* variables, or `fsdp launch --config-file`); without them
// the job uses FSDP version 2, FULL_SHARD and transformer-based wrapping of LlamaDecoderLayer.
#include <fsdp/fsdp.h>

#include <CLI/CLI.hpp>
#include <cstdlib>
#include <iostream>
#include <string>

#include "train_llama/settings.h"
#include "train_llama/training.h"

int main(int argc, char** argv) {
  train_llama::Settings settings;
  CLI::App app{
      "train_llama: train a Llama-architecture byte-level language model with FSDP.\n"
      "Run it under `fsdp launch --nproc-per-node N --`; FSDP settings come from FSDP_* variables or "
      "`fsdp launch --config-file`."};
  train_llama::add_options(app, settings);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& error) {
    return app.exit(error) == 0 ? 0 : 2;
  }
  try {
    auto context = fsdp::DistributedContext::initialize_from_environment();
    // train_llama computes on the CPU: its data, evaluation and sampling are not moved to a GPU yet.
    // Its accelerators say so (AcceleratorOptions::cpu); on a machine with GPUs a note says it, and
    // FSDP_DEVICE=cuda is refused rather than ignored.
    const char* requested_device = std::getenv("FSDP_DEVICE");
    TORCH_CHECK(requested_device == nullptr || std::string(requested_device) != "cuda",
                "train_llama computes on the CPU only; FSDP_DEVICE=cuda is not supported by it yet (the engine and "
                "bench/gpu_bench run on GPUs). Unset FSDP_DEVICE");
    if (requested_device == nullptr && fsdp::cuda_device_count() > 0) {
      if (context.is_main_process())
        std::cerr << "train_llama: note: computing on the CPU (GPUs are visible, but "
                     "train_llama does not use them yet)"
                  << std::endl;
    }
    return settings.eval_only ? train_llama::evaluate_only(settings, context) : train_llama::train(settings, context);
  } catch (const c10::Error& error) {
    std::cerr << "train_llama: error: " << error.what_without_backtrace() << std::endl;
    return 1;
  } catch (const std::exception& error) {
    std::cerr << "train_llama: error: " << error.what() << std::endl;
    return 1;
  }
}
