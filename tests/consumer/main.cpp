// Uses the installed public headers only.
#include <ATen/ATen.h>
#include <fsdp/fsdp.h>

#include <iostream>

int main() {
  auto context = fsdp::DistributedContext::initialize_from_environment();
  auto gathered = at::empty({context.world_size() * 2}, at::kFloat);
  fsdp::all_gather(context.world(), gathered, at::full({2}, 7.0, at::kFloat));
  if (!gathered.equal(at::full({context.world_size() * 2}, 7.0, at::kFloat))) return 1;
  std::cout << "consumer ok: fsdp " << fsdp::version() << " on libtorch " << fsdp::torch_version() << std::endl;
  return 0;
}
