// Benchmark: one training step of an MLP-block model under FSDP, per rank: median step time, bytes
// sent per step against the (N-1)/N theory, and the bytes of parameters, gradients and optimizer state
// each rank holds against 16 bytes/parameter / N. Run under `fsdp launch`; prints one JSON line on
// rank 0. `--strategy SINGLE` runs the whole global batch in one process without FSDP (the compute
// floor). bench/torch_peer.py is the same model under PyTorch's DDP and FSDP2. Rank 0 also reads the
// kernel's byte counter of the loopback interface around the timed steps, as the peer does, so that
// every peer's wire bytes are counted the same way and our own counters are checked. `--model llama` trains
// fsdp::models::LlamaForCausalLM instead (--width = hidden_size, --hidden = intermediate_size,
// --blocks = layers, --batch sequences of --length tokens), each decoder layer a unit.
//
//   fsdp launch --nproc-per-node 2 -- build/bin/step_bench --strategy FULL_SHARD [--model mlp|llama]
//       [--prefetch on|off]
//
// For the large model (bench/large_model.sh): `--heads`, `--kv-heads` and `--untied 1` shape the
// Llama, `--meta-init 1` builds it on the meta device (fully_shard initializes one unit at a time),
// `--checkpoint DIR` saves a SHARDED checkpoint (model and AdamW state) after the steps and loads it
// back, timed against `cp -r` + `sync` and a parallel read of the same files (one JSON line
// "checkpoint"), and `--resume-from DIR` loads one before the steps (any world size; one JSON line
// "resume"), and `--init-from HF_DIR` loads a Hugging Face directory into the sharded model before
// the steps, every rank reading the rows of its own shards, or with `--init-from-rank0 1` rank 0
// reading and sending one tensor at a time (one JSON line "init_from": the path, time, each rank's
// peak RSS growth and bytes read from storage). Loads and reads start with the files evicted from
// the page cache (posix_fadvise), so they come from the disk. `--memory-phases 1` adds the last
// step's peak RSS in its forward, backward and optimizer step, on every rank (one JSON line
// "memory_phases"); the "step" line has every rank's peak RSS and its RSS before the model.
#include <fcntl.h>
#include <fsdp/fsdp.h>
#include <fsdp/models/llama.h>
#include <sys/resource.h>
#include <torch/torch.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iostream>
#include <sstream>
#include <unordered_set>

namespace {

/// Called inside every block's forward and backward: records the most unsharded parameter bytes held
/// at once, to compare with the two largest units (the working set prefetch allows).
std::function<void()> sample_working_set;

struct BlockImpl : torch::nn::Module {
  BlockImpl(int64_t width, int64_t hidden)
      : up(register_module("up", torch::nn::Linear(width, hidden))),
        down(register_module("down", torch::nn::Linear(hidden, width))) {}
  torch::Tensor forward(const torch::Tensor& x) {
    if (sample_working_set) sample_working_set();
    auto inner = fsdp::forward(up, x);
    if (inner.requires_grad() && sample_working_set)
      inner.register_hook([](const torch::Tensor&) { sample_working_set(); });
    return x + fsdp::forward(down, torch::gelu(inner));
  }
  torch::nn::Linear up, down;
};
TORCH_MODULE(Block);

struct StackImpl : torch::nn::Module {
  StackImpl(int64_t width, int64_t hidden, int64_t blocks) {
    for (int64_t index = 0; index < blocks; ++index) {
      layers.push_back(register_module("block" + std::to_string(index), Block(width, hidden)));
    }
  }
  torch::Tensor forward(torch::Tensor x) {
    for (auto& layer : layers) x = fsdp::forward(layer, x);
    return x;
  }
  std::vector<Block> layers;
};
TORCH_MODULE(Stack);

/// Bytes the interface has sent since it came up, or -1 where the counter is not readable.
int64_t interface_bytes(const std::string& name) {
  std::ifstream file("/sys/class/net/" + name + "/statistics/tx_bytes");
  long long value = -1;
  if (!(file >> value)) return -1;
  return value;
}

int64_t loopback_bytes() { return interface_bytes("lo"); }

/// The interface Gloo was told to use (GLOO_SOCKET_IFNAME): the link between machines in
/// bench/multi_hosts.sh, whose counter then shows what left this machine. "" when unset.
std::string link_interface() {
  const char* name = std::getenv("GLOO_SOCKET_IFNAME");
  return name != nullptr ? name : "";
}

int64_t bytes_of(const torch::Tensor& tensor) { return tensor.defined() ? tensor.numel() * tensor.element_size() : 0; }

/// A /proc/self/status field in kB (VmRSS, VmHWM), in MB; -1 where it cannot be read.
double status_mb(const std::string& field) {
  std::ifstream status("/proc/self/status");
  std::string line;
  while (std::getline(status, line)) {
    if (line.rfind(field + ":", 0) == 0) return std::stod(line.substr(field.size() + 1)) / 1024.0;
  }
  return -1;
}

/// Resets VmHWM to the current RSS (Linux's clear_refs "5"), so that the next reading is the peak of
/// what follows; false where the kernel refuses.
bool reset_peak_rss() {
  std::ofstream clear("/proc/self/clear_refs");
  clear << "5";
  clear.flush();
  return static_cast<bool>(clear);
}

/// Bytes this process has read from storage (/proc/self/io read_bytes); -1 where unreadable.
double storage_read_bytes() {
  std::ifstream io("/proc/self/io");
  std::string line;
  while (std::getline(io, line)) {
    if (line.rfind("read_bytes:", 0) == 0) return std::stod(line.substr(11));
  }
  return -1;
}

/// Evicts the files under `directory` from the page cache (posix_fadvise DONTNEED after fsync), so
/// that the next read of them comes from the disk while the program's own code stays cached. False
/// where a file refused.
bool evict_from_page_cache(const std::string& directory) {
  bool all = true;
  for (const auto& item : std::filesystem::recursive_directory_iterator(directory)) {
    if (!item.is_regular_file()) continue;
    const int fd = ::open(item.path().c_str(), O_RDONLY);
    if (fd < 0) {
      all = false;
      continue;
    }
    all = ::fsync(fd) == 0 && ::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED) == 0 && all;
    ::close(fd);
  }
  return all;
}

double seconds_of(const std::function<void()>& body) {
  const auto start = std::chrono::steady_clock::now();
  body();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

int64_t directory_bytes(const std::string& directory) {
  int64_t bytes = 0;
  for (const auto& item : std::filesystem::recursive_directory_iterator(directory)) {
    if (item.is_regular_file()) bytes += static_cast<int64_t>(item.file_size());
  }
  return bytes;
}

}  // namespace

int main(int argc, char** argv) {
  // Launch-to-first-step is measured from here: rendezvous, the model, fully_shard's agreements
  // (Note [Agreement by digest]) and the first step.
  const auto main_started = std::chrono::steady_clock::now();
  std::string strategy = "FULL_SHARD", model_kind = "mlp", prefetch = "on", host_memory = "default";
  // An integer reshard_after_forward for the blocks (hpZ, Note [resharding after forward to a
  // smaller group]); 0: the strategy's choice.
  int64_t reshard_group = 0;
  int64_t steps = 10, width = 512, hidden = 2048, blocks = 8, batch = 64, length = 16, vocab = 8192;
  int64_t heads = 8, kv_heads = 4, untied = 0, meta_init = 0;
  std::string checkpoint_dir, resume_from, init_from;
  int64_t init_from_rank0 = 0, memory_phases = 0;
  for (int index = 1; index + 1 < argc; index += 2) {
    const std::string flag = argv[index], value = argv[index + 1];
    if (flag == "--strategy")
      strategy = value;
    else if (flag == "--model")
      model_kind = value;
    else if (flag == "--prefetch")
      prefetch = value;
    else if (flag == "--steps")
      steps = std::stoll(value);
    else if (flag == "--width")
      width = std::stoll(value);
    else if (flag == "--hidden")
      hidden = std::stoll(value);
    else if (flag == "--blocks")
      blocks = std::stoll(value);
    else if (flag == "--batch")
      batch = std::stoll(value);
    else if (flag == "--length")
      length = std::stoll(value);
    else if (flag == "--vocab")
      vocab = std::stoll(value);
    else if (flag == "--host-memory")
      host_memory = value;
    else if (flag == "--reshard-after-forward")
      reshard_group = std::stoll(value);
    else if (flag == "--heads")
      heads = std::stoll(value);
    else if (flag == "--kv-heads")
      kv_heads = std::stoll(value);
    else if (flag == "--untied")
      untied = std::stoll(value);
    else if (flag == "--meta-init")
      meta_init = std::stoll(value);
    else if (flag == "--checkpoint")
      checkpoint_dir = value;
    else if (flag == "--resume-from")
      resume_from = value;
    else if (flag == "--init-from")
      init_from = value;
    else if (flag == "--memory-phases")
      memory_phases = std::stoll(value);
    else if (flag == "--init-from-rank0")
      init_from_rank0 = std::stoll(value);
    else {
      std::cerr
          << "usage: step_bench [--strategy FULL_SHARD|SHARD_GRAD_OP|NO_SHARD|HYBRID_SHARD|SINGLE] [--model mlp|llama] "
             "[--prefetch on|off] [--steps N] [--width W] [--hidden H] [--blocks B] [--batch GLOBAL] "
             "[--length TOKENS] [--vocab V] [--host-memory default|limit] [--reshard-after-forward K] [--heads H] "
             "[--kv-heads K] [--untied 0|1] [--meta-init 0|1] [--checkpoint DIR] [--resume-from DIR] [--init-from "
             "HF_DIR] [--init-from-rank0 0|1] [--memory-phases 0|1]\n";
      return 2;
    }
  }
  if ((model_kind != "mlp" && model_kind != "llama") || (prefetch != "on" && prefetch != "off") ||
      (host_memory != "limit" && host_memory != "default")) {
    std::cerr << "step_bench: --model takes mlp or llama, --prefetch on or off, --host-memory default or limit\n";
    return 2;
  }
  // The Llama flags mean nothing to the MLP: refused by name rather than ignored.
  if (model_kind == "mlp" && (meta_init != 0 || untied != 0 || !init_from.empty())) {
    std::cerr << "step_bench: --meta-init, --untied and --init-from build a Llama; add --model llama\n";
    return 2;
  }
  try {
    // "limit": AcceleratorOptions::limit_retained_host_memory (host_memory.h); "default": malloc as is.
    if (host_memory == "limit") fsdp::limit_retained_host_memory();
    auto context = fsdp::DistributedContext::initialize_from_environment();
    // libtorch loaded and the groups connected, before the model: what a process costs by itself.
    const double rss_at_start_mb = status_mb("VmRSS");
    const bool single = strategy == "SINGLE";
    const int64_t world = single ? 1 : context.world_size();
    torch::manual_seed(0);
    std::shared_ptr<torch::nn::Module> model;
    std::function<void(torch::nn::Module&)> param_init;
    std::vector<std::shared_ptr<torch::nn::Module>> units;
    std::function<torch::Tensor(const torch::Tensor&)> loss_of;
    torch::Tensor input;
    if (model_kind == "mlp") {
      Stack stack(width, hidden, blocks);
      for (auto& layer : stack->layers) units.push_back(layer.ptr());
      model = stack.ptr();
      input = torch::randn({batch / world, width});
      loss_of = [stack](const torch::Tensor& x) mutable { return fsdp::forward(stack, x).pow(2).mean(); };
    } else {
      fsdp::models::LlamaConfig config;
      config.vocab_size = vocab;
      config.hidden_size = width;
      config.intermediate_size = hidden;
      config.num_hidden_layers = blocks;
      config.num_attention_heads = heads;
      config.num_key_value_heads = kv_heads;
      config.tie_word_embeddings = untied == 0;
      fsdp::models::LlamaForCausalLM llama(nullptr);
      if (meta_init != 0) {
        fsdp::MetaDeviceGuard meta;
        llama = fsdp::models::LlamaForCausalLM(config);
      } else {
        llama = fsdp::models::LlamaForCausalLM(config);
      }
      // A meta-built model gets its values unit by unit, as the constructor would give them.
      if (meta_init != 0) {
        param_init = [impl = llama.ptr()](torch::nn::Module& module) {
          TORCH_CHECK(impl->init_weights(module) || fsdp::reset_parameters(module), "no initializer for ",
                      module.name());
        };
      }
      for (auto& layer : llama->model->decoder_layers) units.push_back(layer.ptr());
      model = llama.ptr();
      input = torch::randint(0, vocab, {batch / world, length + 1});
      loss_of = [llama](const torch::Tensor& tokens) mutable {
        auto logits = fsdp::forward(llama, tokens.narrow(1, 0, tokens.size(1) - 1));
        return fsdp::models::causal_lm_loss(logits, tokens.narrow(1, 1, tokens.size(1) - 1));
      };
    }
    // Parameters as Python counts them (a tied weight once), and those outside every block, which
    // the root unit holds and, as FSDP2's root, does not reshard after forward.
    int64_t parameters = 0, root_parameters = 0;
    std::vector<int64_t> unit_bytes;
    {
      std::unordered_set<const void*> seen, in_blocks;
      for (const auto& unit : units) {
        int64_t bytes = 0;
        for (const auto& parameter : unit->parameters()) {
          in_blocks.insert(parameter.unsafeGetTensorImpl());
          bytes += parameter.numel() * parameter.element_size();
        }
        unit_bytes.push_back(bytes);
      }
      for (const auto& parameter : model->parameters()) {
        if (!seen.insert(parameter.unsafeGetTensorImpl()).second) continue;
        parameters += parameter.numel();
        if (!in_blocks.count(parameter.unsafeGetTensorImpl())) root_parameters += parameter.numel();
      }
    }
    if (!single) {
      fsdp::FullyShardOptions options;
      options.sharding_strategy = fsdp::parse_sharding_strategy(strategy, "--strategy", "the command line");
      options.fsdp1.forward_prefetch = prefetch == "on";
      if (param_init) options.fsdp1.param_init_fn = param_init;
      if (prefetch != "on") options.fsdp1.backward_prefetch.reset();
      auto block_options = options;
      if (reshard_group > 0) block_options.reshard_after_forward = reshard_group;
      for (auto& unit : units) fsdp::fully_shard(unit, context, block_options);
      fsdp::fully_shard(model, context, options);
    }
    int64_t working_set_peak = 0;
    const auto fsdp_units = fsdp::fsdp_modules(*model);
    sample_working_set = [&] {
      int64_t held = 0;
      for (const auto& unit : fsdp_units) held += unit.unsharded_buffer_bytes();
      working_set_peak = std::max(working_set_peak, held);
    };
    // Each parameter once, as PyTorch's model.parameters() gives them: libtorch lists a tied
    // weight for every module holding it, and AdamW would then step it twice.
    std::vector<torch::Tensor> optimized;
    {
      std::unordered_set<const void*> seen;
      for (const auto& parameter : model->parameters()) {
        if (seen.insert(parameter.unsafeGetTensorImpl()).second) optimized.push_back(parameter);
      }
    }
    torch::optim::AdamW optimizer(optimized, torch::optim::AdamWOptions(1e-4));
    // Every rank's figure, gathered on rank 0 by a sum of one-hot rows.
    auto per_rank = [&](double value) {
      auto row = torch::zeros({context.world_size()}, torch::kDouble);
      row[context.rank()] = value;
      fsdp::all_reduce(context.world(), row);
      std::ostringstream text;
      text << "[";
      for (int64_t rank = 0; rank < context.world_size(); ++rank)
        text << (rank ? ", " : "") << row[rank].item<double>();
      text << "]";
      return text.str();
    };
    // `work` on every rank, timed to the last rank's end, and each rank's peak RSS growth during it.
    struct Timed {
      double seconds;
      std::string peak_rss_delta_mb;
    };
    auto timed = [&](const std::function<void()>& work) {
      reset_peak_rss();
      const double before = status_mb("VmRSS");
      const double seconds = seconds_of([&] {
        work();
        fsdp::barrier(context.world());
      });
      return Timed{seconds, per_rank(status_mb("VmHWM") - before)};
    };
    if (!init_from.empty()) {
      // A pretrained model of this shape: every rank reads its rows, or rank 0 reads and sends.
      TORCH_CHECK(!single, "--init-from needs a sharded run, not SINGLE");
      bool cold = context.rank() == 0 && evict_from_page_cache(init_from);
      fsdp::barrier(context.world());
      const double read_before = storage_read_bytes();
      fsdp::PretrainedWeightsOptions load_options;
      load_options.rank0_only = init_from_rank0 != 0;
      const auto load = timed([&] { fsdp::load_pretrained_weights(*model, context, init_from, load_options); });
      const std::string reads = per_rank((storage_read_bytes() - read_before) / 1e6);
      int64_t largest = 0;
      for (const auto& parameter : model->parameters()) largest = std::max<int64_t>(largest, parameter.numel());
      if (context.rank() == 0) {
        std::printf(
            "{\"benchmark\": \"init_from\", \"peer\": \"fsdp.cpp\", \"path\": \"%s\", \"world_size\": %lld, "
            "\"parameters\": %lld, "
            "\"bytes\": %lld, \"load_s\": %.3f, \"page_cache\": \"%s\", \"peak_rss_delta_mb\": %s, "
            "\"storage_read_mb\": %s, \"largest_shard_elements\": %lld}\n",
            init_from_rank0 ? "rank0" : "every_rank", static_cast<long long>(world), static_cast<long long>(parameters),
            static_cast<long long>(directory_bytes(init_from)), load.seconds, cold ? "cold" : "warm",
            load.peak_rss_delta_mb.c_str(), reads.c_str(), static_cast<long long>(largest));
        std::fflush(stdout);
      }
    }
    if (!resume_from.empty()) {
      // A checkpoint saved on any number of ranks, loaded here before the first step.
      TORCH_CHECK(!single, "--resume-from needs a sharded run, not SINGLE");
      const auto load = timed([&] { fsdp::load_checkpoint(resume_from, *model, optimizer, context); });
      if (context.rank() == 0) {
        std::printf(
            "{\"benchmark\": \"resume\", \"peer\": \"fsdp.cpp\", \"world_size\": %lld, \"parameters\": %lld, "
            "\"bytes\": %lld, \"load_s\": %.3f, \"load_peak_rss_delta_mb\": %s}\n",
            static_cast<long long>(world), static_cast<long long>(parameters),
            static_cast<long long>(directory_bytes(resume_from)), load.seconds, load.peak_rss_delta_mb.c_str());
        std::fflush(stdout);
      }
    }
    // --steps 0: the loads above only (bench/init_from.sh).
    if (steps == 0) return 0;
    // HYBRID_SHARD talks over the machine's group and the cross-machine group, the others over the world.
    // hpZ's backward all-gathers run over its post-forward group.
    const fsdp::ProcessGroup* post_forward = reshard_group > 1 && reshard_group < world
                                                 ? &context.consecutive_subgroup(context.world(), reshard_group)
                                                 : nullptr;
    // Over the groups the strategy's collectives use: everything this rank sent, or what it sent to
    // other machines (Note [Byte counters]).
    auto sent_by = [&](int64_t (*field)(const fsdp::CollectiveByteCounters&)) {
      const int64_t extra = post_forward ? field(post_forward->bytes_sent()) : 0;
      if (strategy != "HYBRID_SHARD") return field(context.world().bytes_sent()) + extra;
      return field(context.intra_node().bytes_sent()) + field(context.cross_node().bytes_sent());
    };
    auto bytes_sent = [&] { return sent_by([](const fsdp::CollectiveByteCounters& c) { return c.total(); }); };
    auto off_machine_sent = [&] {
      return sent_by([](const fsdp::CollectiveByteCounters& c) { return c.off_machine; });
    };
    // What this rank holds at the optimizer step: the parameters' storage (shards), their gradients
    // and AdamW's two moments. Measured before zero_grad, which frees the gradients (set_to_none is
    // libtorch 2.x's default, as in PyTorch).
    int64_t state_bytes = 0;
    auto measure_state = [&] {
      state_bytes = 0;
      std::unordered_set<const void*> counted;
      for (const auto& parameter : model->parameters()) {
        if (!counted.insert(parameter.unsafeGetTensorImpl()).second) continue;  // a tied weight, once
        state_bytes += static_cast<int64_t>(parameter.storage().nbytes()) + bytes_of(parameter.grad());
        auto found = optimizer.state().find(fsdp::optimizer_state_key(parameter));
        if (found != optimizer.state().end()) {
          auto& adam = static_cast<torch::optim::AdamWParamState&>(*found->second);
          state_bytes += bytes_of(adam.exp_avg()) + bytes_of(adam.exp_avg_sq());
        }
      }
    };
    std::vector<double> times, losses;
    // Rendezvous, the model and every fully_shard (with its agreement) are done by here.
    const auto setup_done = std::chrono::steady_clock::now();
    auto first_step_done = main_started;
    int64_t bytes_before = 0;
    int64_t off_machine_before = 0;
    int64_t loopback_before = -1;
    const std::string link = link_interface();
    int64_t link_before = -1;
    std::vector<double> phase_peaks;  // --memory-phases
    for (int64_t step = 0; step < steps + 2; ++step) {
      if (step == 2) {
        bytes_before = bytes_sent();
        off_machine_before = off_machine_sent();
      }
      if (!single) fsdp::barrier(context.world());
      if (step == 2 && context.rank() == 0) {
        loopback_before = loopback_bytes();
        if (!link.empty()) link_before = interface_bytes(link);
      }
      const auto start = std::chrono::steady_clock::now();
      // --memory-phases 1: the last step's peak RSS in forward, backward and the optimizer step.
      const bool phases = memory_phases != 0 && step + 1 == steps + 2;
      auto phase_done = [&] {
        if (!phases) return;
        phase_peaks.push_back(status_mb("VmHWM"));
        reset_peak_rss();
      };
      if (phases) {
        phase_peaks.push_back(status_mb("VmHWM"));  // the run's peak so far, which the resets forget
        reset_peak_rss();
      }
      auto loss = loss_of(input);
      losses.push_back(loss.item<double>());
      phase_done();
      loss.backward();
      phase_done();
      optimizer.step();
      phase_done();
      if (step + 1 == steps + 2) measure_state();  // microseconds, in one step of which the median is taken
      optimizer.zero_grad();
      if (!single) fsdp::barrier(context.world());
      if (step >= 2) times.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
      if (step == 0) first_step_done = std::chrono::steady_clock::now();
    }
    if (phase_peaks.size() == 4) {
      const auto forward = per_rank(phase_peaks[1]), backward = per_rank(phase_peaks[2]),
                 optimizer_step = per_rank(phase_peaks[3]);
      if (context.rank() == 0) {
        std::printf(
            "{\"benchmark\": \"memory_phases\", \"forward_peak_mb\": %s, \"backward_peak_mb\": %s, "
            "\"optimizer_step_peak_mb\": %s}\n",
            forward.c_str(), backward.c_str(), optimizer_step.c_str());
      }
    }
    const int64_t bytes_per_step = (bytes_sent() - bytes_before) / steps;
    // Per rank, averaged over the ranks of this machine: a ring's ranks send unequal shares off it.
    auto off_machine_total = torch::tensor({(off_machine_sent() - off_machine_before) / steps}, torch::kLong);
    if (!single) fsdp::all_reduce(context.control(), off_machine_total);  // every rank takes part, once
    const int64_t off_machine_per_step = off_machine_total.item<int64_t>() / world;
    const int64_t loopback_after = context.rank() == 0 ? loopback_bytes() : -1;
    const int64_t link_after = context.rank() == 0 && !link.empty() ? interface_bytes(link) : -1;
    const int64_t link_per_step = link_before >= 0 && link_after >= 0 ? (link_after - link_before) / steps : -1;
    const int64_t loopback_per_step =
        loopback_before >= 0 && loopback_after >= 0 && !single ? (loopback_after - loopback_before) / steps : -1;
    std::sort(times.begin(), times.end());
    std::sort(unit_bytes.rbegin(), unit_bytes.rend());
    const int64_t two_largest_units =
        unit_bytes.empty() ? 0 : unit_bytes[0] + (unit_bytes.size() > 1 ? unit_bytes[1] : 0);
    // Ranks that split the parameters and ranks that hold the same shard: HYBRID_SHARD shards inside a
    // machine and replicates across machines.
    const bool hybrid = strategy == "HYBRID_SHARD";
    const int64_t shard_ranks = single || strategy == "NO_SHARD" ? 1 : hybrid ? context.intra_node().size() : world;
    const int64_t replica_ranks = single ? 1 : world / shard_ranks;
    // FULL_SHARD: all-gather in forward, again in backward for every unit but the root, reduce-scatter.
    // SHARD_GRAD_OP and NO_SHARD: one all-gather (or the all-reduce's second half) and one reduction.
    // HYBRID_SHARD: the same within its machine, then an all-reduce of each shard across machines.
    const double gathered_twice =
        strategy == "FULL_SHARD" || hybrid ? static_cast<double>(parameters - root_parameters) : 0.0;
    const double within = strategy == "NO_SHARD" ? static_cast<double>(world) : static_cast<double>(shard_ranks);
    double theory = single ? 0.0 : (2.0 * parameters + gathered_twice) * (within - 1) / within * 4.0;
    // hpZ: backward's all-gather of the blocks runs over k ranks, each sending k - 1 rows of N / k shards.
    if (post_forward) {
      const double k = static_cast<double>(reshard_group);
      theory = (2.0 * parameters * (within - 1) / within + (parameters - root_parameters) * (k - 1) / k) * 4.0;
    }
    if (hybrid) theory += 2.0 * (replica_ranks - 1) / replica_ranks * parameters * 4.0 / shard_ranks;
    // What each rank must send to the other machines per step (M machines of L ranks, N = M L): a
    // collective over the world sends at least (M - 1)/M of its buffer off each machine, (M - 1)/N of
    // it per rank (Note [Algorithms by measurement]: the two-level algorithms send exactly that);
    // HYBRID_SHARD's and hpZ's collectives inside the machine send nothing off it, HYBRID_SHARD's
    // all-reduce of each shard across the M machines 2 (M - 1)/M of it.
    const double machine_ranks = single ? 1.0 : static_cast<double>(context.intra_node().size());
    const double machines = single ? 1.0 : static_cast<double>(world) / machine_ranks;
    const double off_machine = (machines - 1.0) / static_cast<double>(world);
    double cross_host_theory = 0.0;
    if (hybrid)
      cross_host_theory = 2.0 * (replica_ranks - 1) / replica_ranks * parameters * 4.0 / shard_ranks;
    else if (strategy == "NO_SHARD")
      cross_host_theory = 2.0 * off_machine * parameters * 4.0;
    else if (!single) {
      // Backward's all-gather: over the world (FULL_SHARD), none (SHARD_GRAD_OP), or over k
      // consecutive ranks (hpZ), which leave the machine only when k is more than a machine's ranks.
      double backward_off_machine = gathered_twice > 0 ? off_machine : 0.0;
      if (post_forward) {
        const double k = static_cast<double>(reshard_group);
        backward_off_machine = k > machine_ranks ? (k / machine_ranks - 1.0) / k : 0.0;
      }
      cross_host_theory =
          (off_machine * 2.0 * parameters + backward_off_machine * (parameters - root_parameters)) * 4.0;
    }
    // Only the MLP blocks carry the probe; the Llama layers have no place for it.
    if (model_kind != "mlp") working_set_peak = -1;
    struct rusage usage{};
    ::getrusage(RUSAGE_SELF, &usage);
    // Every rank's peak (estimate-memory gives the largest rank's) and its RSS before the model.
    // --memory-phases resets the kernel's peak (and with it ru_maxrss), so its readings count too.
    double peak_rss = static_cast<double>(usage.ru_maxrss) / 1024.0;
    for (const double phase_peak : phase_peaks) peak_rss = std::max(peak_rss, phase_peak);
    const std::string peak_rss_per_rank = per_rank(peak_rss);
    const std::string rss_at_start_per_rank = per_rank(rss_at_start_mb);
    if (context.rank() == 0) {
      std::printf(
          "{\"benchmark\": \"step\", \"peer\": \"fsdp.cpp\", \"model\": \"%s\", \"strategy\": \"%s\", "
          "\"prefetch\": \"%s\", \"host_memory\": \"%s\", \"world_size\": %lld, \"parameters\": %lld, "
          "\"median_step_s\": %.4f, "
          "\"bytes_sent_per_step\": %lld, \"bytes_theory\": %.0f, \"loopback_bytes_per_step\": %lld, "
          "\"model_state_bytes_per_rank\": %lld, "
          "\"model_state_formula\": %.0f, \"unsharded_peak_bytes\": %lld, \"two_largest_units_bytes\": %lld, "
          "\"peak_rss_mb\": %.1f, \"check_collectives\": %d, \"setup_s\": %.3f, \"start_to_first_step_s\": %.3f, "
          "\"control_bytes\": %lld, \"reshard_after_forward\": %lld, \"link\": \"%s\", \"link_tx_bytes_per_step\": "
          "%lld, "
          "\"cross_host_theory_per_rank\": %.0f, \"ranks_per_machine\": %lld, \"off_machine_bytes_per_step\": %lld, "
          "\"peak_rss_mb_per_rank\": %s, \"rss_at_start_mb_per_rank\": %s}\n",
          model_kind.c_str(), strategy.c_str(), prefetch.c_str(), host_memory.c_str(), static_cast<long long>(world),
          static_cast<long long>(parameters), times[times.size() / 2], static_cast<long long>(bytes_per_step), theory,
          static_cast<long long>(loopback_per_step), static_cast<long long>(state_bytes),
          16.0 * parameters / shard_ranks, static_cast<long long>(working_set_peak),
          static_cast<long long>(two_largest_units), peak_rss, context.environment().check_collectives ? 1 : 0,
          std::chrono::duration<double>(setup_done - main_started).count(),
          std::chrono::duration<double>(first_step_done - main_started).count(),
          static_cast<long long>(context.control().bytes_sent().total()), static_cast<long long>(reshard_group),
          link.c_str(), static_cast<long long>(link_per_step), cross_host_theory, static_cast<long long>(machine_ranks),
          static_cast<long long>(off_machine_per_step), peak_rss_per_rank.c_str(), rss_at_start_per_rank.c_str());
    }
    if (!checkpoint_dir.empty()) {
      // SHARDED save of model and AdamW state (fsynced, as every file the library writes), then a
      // load of it with its files evicted from the page cache, against cp -r + sync of the same
      // files and a read of them (evicted again) by as many processes as there are ranks.
      TORCH_CHECK(!single, "--checkpoint needs a sharded run, not SINGLE");
      const std::string copy = checkpoint_dir + ".copy";
      if (context.rank() == 0) {
        std::filesystem::remove_all(checkpoint_dir);
        std::filesystem::remove_all(copy);
      }
      fsdp::barrier(context.world());
      // What this rank sent for the save's and the load's coordination (the control channel and the
      // world's collectives), how many collectives it issued, and the CPU seconds its process spent
      // (every thread: on this oversubscribed machine wall time grows with N whatever the work).
      // Rank 0 also reads the loopback's counter, which torch_peer.py reads the same way for DCP.
      struct Sent {
        int64_t bytes = 0, messages = 0, collectives = 0;
        double cpu_s = 0;
        int64_t loopback = -1;
      };
      auto cpu_seconds = [] {
        rusage now{};
        getrusage(RUSAGE_SELF, &now);
        return now.ru_utime.tv_sec + now.ru_stime.tv_sec + (now.ru_utime.tv_usec + now.ru_stime.tv_usec) / 1e6;
      };
      auto counted = [&](const std::function<void()>& work) {
        const auto control = context.control().bytes_sent(), data = context.world().bytes_sent();
        const int64_t loopback = context.rank() == 0 ? loopback_bytes() : -1;
        context.control().start_trace();
        context.world().start_trace();
        const double cpu = cpu_seconds();
        work();
        Sent sent;
        sent.cpu_s = cpu_seconds() - cpu;
        sent.collectives =
            static_cast<int64_t>(context.world().stop_trace().size() + context.control().stop_trace().size());
        const auto control_after = context.control().bytes_sent(), data_after = context.world().bytes_sent();
        sent.bytes = control_after.total() + data_after.total() - control.total() - data.total();
        sent.messages = control_after.messages + data_after.messages - control.messages - data.messages;
        fsdp::barrier(context.world());  // every rank's part on the loopback, as the peer's barrier
        if (loopback >= 0) sent.loopback = loopback_bytes() - loopback;
        return sent;
      };
      Sent save_sent, load_sent;
      const auto save = timed([&] {
        fsdp::TrainingProgress progress;
        progress.step = steps + 2;
        save_sent = counted([&] { fsdp::save_checkpoint(checkpoint_dir, *model, optimizer, context, progress); });
      });
      bool cold = context.rank() == 0 && evict_from_page_cache(checkpoint_dir);
      fsdp::barrier(context.world());
      const auto load = timed(
          [&] { load_sent = counted([&] { fsdp::load_checkpoint(checkpoint_dir, *model, optimizer, context); }); });
      auto each = [&](const Sent& sent) {
        return "\"sent_bytes\": " + per_rank(static_cast<double>(sent.bytes)) +
               ", \"sent_messages\": " + per_rank(static_cast<double>(sent.messages)) +
               ", \"collectives\": " + per_rank(static_cast<double>(sent.collectives)) +
               ", \"cpu_s\": " + per_rank(sent.cpu_s) + ", \"loopback_bytes\": " + std::to_string(sent.loopback);
      };
      const std::string save_counts = each(save_sent), load_counts = each(load_sent);
      if (context.rank() == 0) {
        const int64_t bytes = directory_bytes(checkpoint_dir);
        const double cp = seconds_of([&] {
          TORCH_CHECK(std::system(("cp -r " + checkpoint_dir + " " + copy + " && sync").c_str()) == 0, "cp failed");
        });
        std::filesystem::remove_all(copy);
        cold = cold && evict_from_page_cache(checkpoint_dir);
        const double read = seconds_of([&] {
          TORCH_CHECK(std::system(("find " + checkpoint_dir + " -type f -print0 | xargs -0 -n 1 -P " +
                                   std::to_string(world) + " cat > /dev/null")
                                      .c_str()) == 0,
                      "reading the checkpoint failed");
        });
        std::printf(
            "{\"benchmark\": \"checkpoint\", \"peer\": \"fsdp.cpp\", \"world_size\": %lld, \"parameters\": %lld, "
            "\"bytes\": %lld, \"save_s\": %.3f, \"load_s\": %.3f, \"cp_sync_s\": %.3f, \"read_s\": %.3f, "
            "\"page_cache\": \"%s\", \"save_peak_rss_delta_mb\": %s, \"load_peak_rss_delta_mb\": %s, "
            "\"save\": {%s}, \"load\": {%s}, \"losses\": [",
            static_cast<long long>(world), static_cast<long long>(parameters), static_cast<long long>(bytes),
            save.seconds, load.seconds, cp, read, cold ? "cold" : "warm", save.peak_rss_delta_mb.c_str(),
            load.peak_rss_delta_mb.c_str(), save_counts.c_str(), load_counts.c_str());
        for (size_t index = 0; index < losses.size(); ++index) std::printf("%s%.6f", index ? ", " : "", losses[index]);
        std::printf("]}\n");
      }
      fsdp::barrier(context.world());
    } else if (!resume_from.empty() && context.rank() == 0) {
      std::printf("{\"benchmark\": \"resume_losses\", \"world_size\": %lld, \"losses\": [",
                  static_cast<long long>(world));
      for (size_t index = 0; index < losses.size(); ++index) std::printf("%s%.6f", index ? ", " : "", losses[index]);
      std::printf("]}\n");
    }
  } catch (const c10::Error& error) {
    std::cerr << "step_bench: " << error.what_without_backtrace() << "\n";
    return 1;
  }
  return 0;
}
