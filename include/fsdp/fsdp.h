// Umbrella header: everything a user of fsdp.cpp needs.
#pragma once

#include <fsdp/accelerator.h>
#include <fsdp/activation_checkpointing.h>
#include <fsdp/auto_wrap.h>
#include <fsdp/checkpoint.h>
#include <fsdp/clip_grad_norm.h>
#include <fsdp/collectives.h>
#include <fsdp/distributed_environment.h>
#include <fsdp/fsdp2_prepare.h>
#include <fsdp/fully_shard.h>
#include <fsdp/meta_device.h>
#include <fsdp/host_memory.h>
#include <fsdp/merge.h>
#include <fsdp/plugin.h>
#include <fsdp/pretrained_model.h>
#include <fsdp/pretrained_weights.h>
#include <fsdp/process_group.h>
#include <fsdp/safetensors.h>
#include <fsdp/shard_layout.h>
#include <fsdp/sharding_options.h>
#include <fsdp/dcp.h>
#include <fsdp/sharded_checkpoint.h>
#include <fsdp/state_dict.h>
#include <fsdp/state_dict_options.h>
#include <fsdp/torch_file.h>
#include <fsdp/version.h>
