#include <c10/util/Exception.h>
#include <fsdp/state_dict_options.h>

namespace fsdp {

const char* to_string(StateDictType type) {
  switch (type) {
    case StateDictType::kFullStateDict:
      return "FULL_STATE_DICT";
    case StateDictType::kLocalStateDict:
      return "LOCAL_STATE_DICT";
    case StateDictType::kShardedStateDict:
      return "SHARDED_STATE_DICT";
  }
  TORCH_INTERNAL_ASSERT(false, "StateDictType ", static_cast<int>(type), " has no name");
}

}  // namespace fsdp
