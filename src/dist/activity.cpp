#include "dist/activity.h"

#include <utility>

namespace fsdp::detail {
namespace {

thread_local std::string activity;

}  // namespace

ActivityScope::ActivityScope(std::string next) : previous_(std::exchange(activity, std::move(next))) {}

ActivityScope::~ActivityScope() { activity = std::move(previous_); }

const std::string& current_activity() { return activity; }

}  // namespace fsdp::detail
