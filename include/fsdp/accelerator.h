// Accelerator: the object a training script holds (Accelerate's `Accelerator`, FSDP parts).
//
// It owns the process groups and the resolved plugin, and prepares a model and its optimizer
// together (Accelerate's `Accelerator._prepare_fsdp2`): the model is sharded in place and the optimizer is
// switched to the sharded parameters, keeping its parameter groups and hyper-parameters.
#pragma once

#include <fsdp/async_checkpoint.h>
#include <fsdp/checkpoint.h>
#include <fsdp/data_split.h>
#include <fsdp/plugin.h>
#include <fsdp/process_group.h>
#include <fsdp/sharded_grad_scaler.h>
#include <fsdp/state_dict.h>
#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

#include <memory>
#include <optional>
#include <string>

namespace fsdp {

struct AcceleratorOptions {
  /// "no", "fp16", "bf16" (Accelerate's mixed_precision). Unset: ACCELERATE_MIXED_PRECISION, else "no".
  std::optional<std::string> mixed_precision;
  /// The FSDP configuration. Unset: resolved from the FSDP_* environment variables.
  std::optional<FullyShardedDataParallelPlugin> fsdp_plugin;
  /// Micro-batches per optimizer step (gradient_accumulation_steps). Default: 1.
  int64_t gradient_accumulation_steps = 1;
  /// save_state() without a directory writes <project_dir>/checkpoints/checkpoint_<i>. Default: ".".
  std::string project_dir = ".";
  /// Automatic checkpoints to keep (the oldest are deleted by the main process); 0 keeps all. Default: 0.
  int64_t total_limit = 0;
  /// Call limit_retained_host_memory() (host_memory.h): freed blocks of 1 MiB and more leave the
  /// process instead of staying in malloc's heap, for about 10% more step time here (page faults).
  /// Process-wide. Default: false.
  bool limit_retained_host_memory = false;
  /// Compute on the CPU even where GPUs are visible (Accelerate's cpu=True): device() is the CPU and
  /// prepare() leaves the model in host memory. The plugin's cpu_offload computes offloaded units
  /// on default_device() (a GPU when there is one), so that combination on a machine with GPUs is
  /// an error naming both. Default: false.
  bool cpu = false;
  /// How prepare_batches() shares a loader's batches among the ranks: each batch cut into one piece
  /// per rank instead of whole batches dealt in turn (Accelerate's DataLoaderConfiguration
  /// split_batches, data_split.h). Default: false.
  bool split_batches = false;
  /// Complete the last round of batches from the first rows so every rank gets as many full batches
  /// (DataLoaderConfiguration.even_batches). Default: true.
  bool even_batches = true;
};

/// One line saying what Accelerator::prepare did: FSDP version, strategy, wrap policy, the units it
/// made (count and the first 3 module paths, then the root), state_dict_type and mixed precision.
std::string preparation_summary(const FullyShardedDataParallelPlugin& plugin, const std::string& mixed_precision,
                                torch::nn::Module& model);

/// How Accelerator::save_state saves.
struct SaveStateOptions {
  /// Write the files on a thread while training continues (AsyncCheckpointer, Note [asynchronous
  /// checkpoints]): save_state returns once this rank's state is copied into its staging buffer, and
  /// the checkpoint counts once finish_checkpoint() has finished it, which step() tries after each
  /// optimizer step. SHARDED_STATE_DICT only (an error names the plugin's other type). fsdp.cpp's
  /// own option: Accelerate 1.15's save_state has none (PyTorch's is dcp.async_save). Default: false.
  bool async = false;
};

/// The checkpoint options the plugin describes: its state_dict_type and, for FULL saves, its
/// state_dict_config and optim_state_dict_config. Accelerator::save_state uses them.
CheckpointOptions checkpoint_options_from_plugin(const FullyShardedDataParallelPlugin& plugin);

class Accelerator {
 public:
  explicit Accelerator(DistributedContext context, AcceleratorOptions options = {},
                       const EnvironmentMap& environment = current_process_environment());

  const DistributedContext& context() const { return context_; }
  FullyShardedDataParallelPlugin& fsdp_plugin() { return plugin_; }
  const FullyShardedDataParallelPlugin& fsdp_plugin() const { return plugin_; }
  /// "no", "fp16" or "bf16".
  const std::string& mixed_precision() const { return mixed_precision_; }
  bool is_main_process() const { return context_.is_main_process(); }
  int64_t process_index() const { return context_.rank(); }
  int64_t num_processes() const { return context_.world_size(); }
  /// Where this rank computes (Accelerate's `accelerator.device`): `cuda:<LOCAL_RANK>` on a build with
  /// the GPU path when GPUs are visible, else CPU (fsdp::default_device, which FSDP_DEVICE steers).
  c10::Device device() const;

  /// Moves `model` to device() (unless cpu_offload keeps its shards in host memory, or it is on the
  /// meta device), shards it in place (fsdp2_prepare_model) and switches `optimizer`'s parameters to
  /// the sharded ones. The optimizer must not have stepped yet. Collective: every rank calls it.
  std::shared_ptr<torch::nn::Module> prepare(const std::shared_ptr<torch::nn::Module>& model,
                                             torch::optim::Optimizer& optimizer);
  template <typename ModuleHolder>
  ModuleHolder prepare(ModuleHolder model, torch::optim::Optimizer& optimizer) {
    prepare(std::shared_ptr<torch::nn::Module>(model.ptr()), optimizer);
    return model;
  }

  /// Accelerate's prepare(dataloader) for a loader of `batch_size` rows per batch over `order` (a
  /// dataset's row indices: sequential_order(rows), or seeded_random_order(rows, seed, epoch) for
  /// shuffle=True, the same seed on every rank): this rank's batches, by the options' split_batches
  /// and even_batches (data_split.h). Rows, not tensors: index your dataset with them.
  std::vector<std::vector<int64_t>> prepare_batches(const std::vector<int64_t>& order, int64_t batch_size,
                                                    bool drop_last = false) const;

  /// Accelerate's backward: the loss divided by gradient_accumulation_steps, scaled by the gradient
  /// scaler when there is one, then backward.
  void backward(const torch::Tensor& loss);
  /// The fp16 gradient scaler (Accelerate's `accelerator.scaler`, a ShardedGradScaler under FSDP):
  /// made when mixed_precision is "fp16" and device() is a GPU; null otherwise (fp16 on the CPU runs
  /// without one, as Accelerate does there).
  ShardedGradScaler* scaler() { return scaler_ ? &*scaler_ : nullptr; }
  /// Steps the prepared optimizer, as Accelerate's AcceleratedOptimizer.step(): through the scaler
  /// (unscale, skip on inf or NaN on any rank, update the scale) when there is one. Returns whether
  /// the optimizer stepped. Collective with a scaler.
  bool step();
  /// Whether the last step() was skipped for inf or NaN gradients (accelerator.optimizer_step_was_skipped).
  bool optimizer_step_was_skipped() const { return step_was_skipped_; }

  /// One micro-batch of gradient accumulation (Accelerate's `with accelerator.accumulate(model)`):
  /// gradients are reduced across ranks only on the last micro-batch of each optimizer step, when
  /// sync_gradients() is true; step the optimizer only then.
  class AccumulateScope {
   public:
    explicit AccumulateScope(Accelerator& accelerator);
    /// Gradient sync is on again after the scope, as after Accelerate's no_sync.
    ~AccumulateScope();
    AccumulateScope(const AccumulateScope&) = delete;
    AccumulateScope& operator=(const AccumulateScope&) = delete;

   private:
    Accelerator& accelerator_;
  };
  AccumulateScope accumulate() { return AccumulateScope(*this); }
  /// Whether the current micro-batch ends an optimizer step (always true without accumulation).
  bool sync_gradients() const { return sync_gradients_; }
  int64_t gradient_accumulation_steps() const { return gradient_accumulation_steps_; }

  /// Global gradient norm of the prepared model, clipped to max_norm (fsdp::clip_grad_norm_); with a
  /// scaler the gradients are unscaled first, as Accelerate's clip_grad_norm_ does.
  double clip_grad_norm_(double max_norm, double norm_type = 2.0);
  /// Every rank's tensor concatenated on dim 0; a 0-dim tensor gives one element per rank, as
  /// Accelerate's gather. All ranks pass the same shape: shapes that differ are an error on every
  /// rank (Note [Collective check]). One tensor, not Accelerate's nested containers. Collective.
  at::Tensor gather(const at::Tensor& tensor) const;
  /// Sum or mean over ranks ("sum" / "mean"); the mean of an integer tensor is an error, as in
  /// Accelerate on several processes (on one process Accelerate returns the tensor without reducing
  /// and without that error; here one rank checks as many do). No `scale` (Accelerate applies its
  /// scale only on XLA). Collective.
  at::Tensor reduce(const at::Tensor& tensor, const std::string& reduction = "mean") const;
  /// Prints a line on the main process only.
  void print(const std::string& line) const;
  void wait_for_everyone() const;

  /// The prepared model's full state dict on rank 0 (other ranks get an empty list). Collective.
  TensorList get_state_dict();
  /// Hugging Face layout in `directory`: model.safetensors, or shards of at most max_shard_size bytes
  /// with model.safetensors.index.json (pytorch_model.bin when safe_serialization is false). Rank 0
  /// writes. Collective.
  void save_model(const std::string& directory, int64_t max_shard_size = 10'000'000'000,
                  bool safe_serialization = true);

  /// save_state into <project_dir>/checkpoints/checkpoint_<i>, i counting up from the highest
  /// existing one, pruning beyond total_limit (complete checkpoints only count: an asynchronous
  /// save's older ones are pruned when it finishes). Returns the directory. Collective.
  std::string save_state(const TrainingProgress& progress, const SaveStateOptions& options = {});
  /// The newest complete automatic checkpoint, or "" when there is none.
  std::string latest_checkpoint() const;
  /// How many times the launcher has restarted this job after a failure (TORCHELASTIC_RESTART_COUNT,
  /// `fsdp launch --max-restarts`); 0 on the first start.
  int64_t restart_count() const { return context_.environment().restart_count; }
  /// On a restart (restart_count() above 0): load_state() of the latest complete automatic
  /// checkpoint, as rank 0 finds it, and its progress; with none, the job starts from step 0 and
  /// nothing is loaded (nullopt). Either way the main process prints one line saying which. On the
  /// first start: nullopt, nothing read. Call it once after prepare(). Collective.
  /// (Note [restarting a failed job], src/launch/launcher.cpp.)
  std::optional<TrainingProgress> resume_after_restart();

  /// Saves the prepared model and optimizer with the plugin's state_dict_type, plus `progress`
  /// (Accelerate's save_state; layout in checkpoint.h). The optimizer passed to prepare must still
  /// exist. Collective.
  /// With options.async, at most one save is in flight: a save started before the last one's files
  /// are written waits for them first, and the main process says how long it waited.
  void save_state(const std::string& directory, const TrainingProgress& progress = {},
                  const SaveStateOptions& options = {});
  /// Finishes an asynchronous save in flight (AsyncCheckpointer::finish): with `wait`, after this
  /// rank's files are written; without, only if every rank's are (one all-reduce of one flag).
  /// Returns whether none is in flight afterwards. A failed write is raised here on every rank. Call
  /// it with `wait` before the program ends, or the last asynchronous checkpoint stays incomplete.
  /// Collective; step() calls it without `wait`.
  bool finish_checkpoint(bool wait = true);
  /// Restores what save_state wrote and returns the progress (finishing an asynchronous save in
  /// flight first). Collective.
  TrainingProgress load_state(const std::string& directory);

 private:
  /// Ranks that would prepare differently (another plugin from their environment, another model)
  /// get one error naming each difference, before any collective.
  void agree_on_preparation(torch::nn::Module& model, torch::optim::Optimizer& optimizer) const;
  /// The main process prints what prepare did (preparation_summary), and warns when nothing was
  /// configured at all: with Accelerate's defaults the whole model is one unit, which a user does not
  /// see in C++ without it.
  void report_preparation(torch::nn::Module& model) const;
  DistributedContext context_;
  FullyShardedDataParallelPlugin plugin_;
  std::string mixed_precision_;
  std::shared_ptr<torch::nn::Module> model_;
  torch::optim::Optimizer* optimizer_ = nullptr;
  int64_t gradient_accumulation_steps_ = 1;
  int64_t micro_step_ = 0;
  bool sync_gradients_ = true;
  std::optional<ShardedGradScaler> scaler_;
  bool step_was_skipped_ = false;
  /// Deletes automatic checkpoints beyond total_limit (main process), then waits for every rank.
  void rotate_checkpoints();
  std::string project_dir_;
  int64_t total_limit_ = 0;
  bool cpu_ = false;
  BatchSplitOptions batch_split_;
  std::unique_ptr<AsyncCheckpointer> async_checkpointer_;
  /// The asynchronous save in flight was an automatic one: rotate when it finishes.
  bool rotate_after_finish_ = false;
};

/// Accelerate's fsdp2_prepare_model(accelerator, model): fsdp2_prepare.h's with the accelerator's
/// plugin, process groups and mixed precision.
std::shared_ptr<torch::nn::Module> fsdp2_prepare_model(Accelerator& accelerator,
                                                       const std::shared_ptr<torch::nn::Module>& model);
/// Accelerate's fsdp2_load_full_state_dict(accelerator, model, full_sd): fsdp2_prepare.h's with the
/// accelerator's process groups.
std::shared_ptr<torch::nn::Module> fsdp2_load_full_state_dict(Accelerator& accelerator,
                                                              const std::shared_ptr<torch::nn::Module>& model,
                                                              const TensorList& full_state_dict,
                                                              bool cpu_offload = false);

}  // namespace fsdp
