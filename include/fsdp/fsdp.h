// Umbrella header: everything a user of fsdp.cpp needs.
#pragma once

#include <fsdp/collectives.h>
#include <fsdp/distributed_environment.h>
#include <fsdp/process_group.h>
#include <fsdp/version.h>
