// Private to train_llama: the model it trains, built where it must be and filled from a Hugging
// Face directory without any rank holding more than it needs.
#pragma once

#include <fsdp/models/llama.h>
#include <fsdp/process_group.h>

#include <string>

namespace train_llama {

/// The model to train or evaluate. With weights to load (`from_weights`), only rank 0 reads them; the
/// other ranks build the model on the meta device, allocating nothing, and receive their shards from
/// rank 0 (cpu_ram_efficient_loading), as transformers' non-main processes do under Accelerate.
/// With `meta_init` every rank builds it on the meta device: fully_shard gives each unit its initial
/// values one unit at a time (Note [building on the meta device]), or, with weights, zeros that
/// stream_pretrained_weights then fills: no rank ever holds the whole model.
fsdp::models::LlamaForCausalLM build_model(const fsdp::models::LlamaConfig& config, bool from_weights, bool meta_init,
                                           const fsdp::DistributedContext& context);

/// Copies a Hugging Face directory's weights into the (not yet sharded) model on rank 0; a bad
/// directory is an error on every rank.
void load_weights_on_rank0(fsdp::models::LlamaForCausalLM& model, const std::string& directory,
                           const fsdp::DistributedContext& context);

/// Fills the sharded model from a Hugging Face directory: every rank opens its files and reads the
/// rows of its own shards (fsdp::load_pretrained_weights), holding no more than them and the rows
/// it reads; with `rank0_only`, rank 0 alone opens them and sends one tensor at a time, every rank
/// keeping its rows (fsdp::load_model_state_dict_from_rank0), rank 0 holding one full tensor beyond
/// its shards. Extra tensors in the files (an untied head for a tied config) are refused as
/// load_weights_on_rank0 refuses them. The files are opened once per reading rank.
void stream_pretrained_weights(fsdp::models::LlamaForCausalLM& model, const std::string& directory, bool rank0_only,
                               const fsdp::DistributedContext& context);

}  // namespace train_llama
