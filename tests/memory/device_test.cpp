// fsdp::default_device and the stream helpers where no GPU is visible (every CPU machine, and CI):
// FSDP_DEVICE is read and checked, a request for a GPU that is not there is a named error, and the
// stream helpers are no-ops on the CPU. tests/gpu/gpu_test.cpp covers the GPU side.
#include "memory/device.h"

#include <ATen/ATen.h>
#include <fsdp/device.h>
#include <gtest/gtest.h>

#include <cstdlib>
#include <optional>
#include <string>

namespace fsdp {
namespace {

// Sets FSDP_DEVICE for one scope and restores what was there.
class DeviceVariable {
 public:
  explicit DeviceVariable(const char* value) {
    if (const char* old = std::getenv("FSDP_DEVICE")) previous_ = old;
    if (value) {
      ::setenv("FSDP_DEVICE", value, 1);
    } else {
      ::unsetenv("FSDP_DEVICE");
    }
  }
  ~DeviceVariable() {
    if (previous_) {
      ::setenv("FSDP_DEVICE", previous_->c_str(), 1);
    } else {
      ::unsetenv("FSDP_DEVICE");
    }
  }

 private:
  std::optional<std::string> previous_;
};

std::string error_of(const std::function<void()>& call) {
  try {
    call();
  } catch (const c10::Error& error) {
    return error.what_without_backtrace();
  }
  return "no error";
}

TEST(Device, WithoutAGpuEveryRankComputesOnTheCpu) {
  if (cuda_device_count() > 0) GTEST_SKIP() << "this process sees a GPU";
  const DeviceVariable unset(nullptr);
  EXPECT_EQ(default_device(0), c10::Device(c10::kCPU));
  EXPECT_EQ(default_device(7), c10::Device(c10::kCPU));
}

TEST(Device, FsdpDeviceCpuAlwaysGivesTheCpu) {
  const DeviceVariable cpu("cpu");
  EXPECT_EQ(default_device(0), c10::Device(c10::kCPU));
}

TEST(Device, AnUnknownFsdpDeviceIsANamedError) {
  const DeviceVariable bad("gpu0");
  const auto message = error_of([] { default_device(0); });
  EXPECT_NE(message.find("FSDP_DEVICE='gpu0' is not a device"), std::string::npos) << message;
  EXPECT_NE(message.find("expected 'cpu' or 'cuda'"), std::string::npos) << message;
}

TEST(Device, AskingForAGpuThatIsNotThereSaysWhy) {
  if (cuda_device_count() > 0) GTEST_SKIP() << "this process sees a GPU";
  const DeviceVariable cuda("cuda");
  const auto message = error_of([] { default_device(1); });
  EXPECT_NE(message.find("[local rank 1] FSDP_DEVICE=cuda but"), std::string::npos) << message;
  // Which of the two reasons depends on the build: both name the way out.
  EXPECT_NE(message.find(built_with_cuda() ? "sees no GPU" : "has no GPU path"), std::string::npos) << message;
  EXPECT_NE(message.find("Unset FSDP_DEVICE"), std::string::npos) << message;
}

TEST(Device, StreamHelpersDoNothingOnTheCpu) {
  const c10::Device cpu(c10::kCPU);
  EXPECT_FALSE(detail::has_streams(cpu));
  // No-ops, not errors: the engine calls them only where has_streams, but they must be safe anyway.
  const detail::StreamScope nothing(std::nullopt);
  detail::record_stream(at::ones({2}), c10::Stream(c10::Stream::DEFAULT, cpu));
  auto host = detail::empty_host({3}, at::kFloat, /*pin_memory=*/true);
  EXPECT_TRUE(host.device().is_cpu());
  EXPECT_EQ(host.numel(), 3);
  if (cuda_device_count() == 0) {
    EXPECT_FALSE(host.is_pinned()) << "no GPU: ordinary host memory";
  }
}

}  // namespace
}  // namespace fsdp
