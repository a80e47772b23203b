// The CPU collectives' algorithms (Note [Algorithms by measurement], src/dist/collective_algorithm.h):
// direct, ring and two-level schedules of point-to-point messages on the collective's slot (Note
// [Collective check]), between the caller's buffers and pooled staging blocks. The first step is
// posted when the collective is issued; a step that needs an earlier one's result runs on the
// group's issue queue, so an `_async` call returns at once and every rank runs them in one order.
#include <ATen/ATen.h>
#include <c10/core/InferenceMode.h>

#include <cstdio>
#include <cstdlib>

#include "dist/c10d/internal.h"
#include "memory/buffer_pool.h"

namespace fsdp::detail {

void reduce_rows_into(const at::Tensor& output, const at::Tensor& rows, ReduceOp op) {
  // Pairwise adds stream through memory once per row; at::sum over dim 0 of the same rows is 3.5x
  // slower here. bf16 and fp16 accumulate in fp32, which also makes a pre-divide unnecessary against
  // overflow.
  const auto dtype = rows.scalar_type();
  const int64_t count = rows.size(0);
  if (dtype == at::kBool) {
    output.copy_(op == ReduceOp::kMin ? rows.all(0) : rows.any(0));
    return;
  }
  const bool widen = op == ReduceOp::kSum && (dtype == at::kBFloat16 || dtype == at::kHalf);
  auto accumulator = widen ? rows[0].to(at::kFloat) : output;
  if (!widen) accumulator.copy_(rows[0]);
  for (int64_t row = 1; row < count; ++row) {
    switch (op) {
      case ReduceOp::kSum:
        accumulator.add_(rows[row]);
        break;
      case ReduceOp::kMax:
        at::maximum_out(accumulator, accumulator, rows[row]);
        break;
      case ReduceOp::kMin:
        at::minimum_out(accumulator, accumulator, rows[row]);
        break;
    }
  }
  if (widen) output.copy_(accumulator);
}

namespace {

at::Tensor as_bytes(const at::Tensor& tensor) { return tensor.reshape({-1}).view(at::kByte); }

// `partial` <- `partial` (op) `own`: one step of a ring's reduction, in the order the ring adds
// (fp16 and bf16 sums add in fp32 and round once per step).
void accumulate(const at::Tensor& partial, const at::Tensor& own, ReduceOp op) {
  const auto dtype = partial.scalar_type();
  if (dtype == at::kBool) {
    partial.copy_(op == ReduceOp::kMin ? partial.logical_and(own) : partial.logical_or(own));
    return;
  }
  switch (op) {
    case ReduceOp::kSum:
      if (dtype == at::kBFloat16 || dtype == at::kHalf) {
        partial.copy_(partial.to(at::kFloat).add_(own.to(at::kFloat)));
      } else {
        partial.add_(own);
      }
      return;
    case ReduceOp::kMax: {
      at::Tensor out = partial;
      at::maximum_out(out, partial, own);
      return;
    }
    case ReduceOp::kMin: {
      at::Tensor out = partial;
      at::minimum_out(out, partial, own);
      return;
    }
  }
}

// The group ranks `rank_at(position + 1)`, ..., `rank_at(position + count - 1)` (indices mod count):
// every other member of a set of `count`, each rank starting with its successor so that no peer is
// everyone's first.
std::vector<int64_t> others_after(int64_t position, int64_t count, const std::function<int64_t(int64_t)>& rank_at) {
  std::vector<int64_t> peers;
  for (int64_t offset = 1; offset < count; ++offset) peers.push_back(rank_at((position + offset) % count));
  return peers;
}

// Where this rank sits in a two-level group: machine `machine` of `machines`, local index `local` of
// `per_machine` (Note [Algorithms by measurement]: group rank g is on machine g / L).
struct TwoLevel {
  int64_t machines = 1;
  int64_t per_machine = 1;
  int64_t machine = 0;
  int64_t local = 0;

  explicit TwoLevel(const GroupMembers& members)
      : machines(members.shape.machines),
        per_machine(members.shape.ranks_per_machine),
        machine(members.rank / members.shape.ranks_per_machine),
        local(members.rank % members.shape.ranks_per_machine) {}
  int64_t rank_of(int64_t on_machine, int64_t at_local) const { return on_machine * per_machine + at_local; }
  int64_t machine_of(int64_t group_rank) const { return group_rank / per_machine; }
  int64_t local_of(int64_t group_rank) const { return group_rank % per_machine; }
  // The other ranks of this machine, and the ranks of this local index on the other machines.
  std::vector<int64_t> inside() const {
    return others_after(local, per_machine, [this](int64_t index) { return rank_of(machine, index); });
  }
  std::vector<int64_t> across() const {
    return others_after(machine, machines, [this](int64_t index) { return rank_of(index, local); });
  }
  // The ring of this local index over every machine, in machine order (this rank at `machine`).
  std::vector<int64_t> across_ring() const {
    std::vector<int64_t> ring;
    for (int64_t index = 0; index < machines; ++index) ring.push_back(rank_of(index, local));
    return ring;
  }
};

std::vector<int64_t> everyone(int64_t size) {
  std::vector<int64_t> ring(static_cast<size_t>(size));
  for (int64_t rank = 0; rank < size; ++rank) ring[static_cast<size_t>(rank)] = rank;
  return ring;
}

// The first `count` works of `exchange` (its receives, which exchange_with posts first) apart from
// the rest (its sends).
std::pair<Exchange, Exchange> split_receives(Exchange exchange, size_t count) {
  Exchange receives, sends;
  for (size_t index = 0; index < exchange.works.size(); ++index) {
    (index < count ? receives : sends).add(exchange.works[index], exchange.peers[index]);
  }
  return {std::move(receives), std::move(sends)};
}

// Piece `piece`'s works of `all`, an exchange posted piece by piece, `per_piece` works each.
Exchange piece_of(const Exchange& all, int64_t piece, size_t per_piece) {
  Exchange part;
  for (size_t work = 0; work < per_piece; ++work) {
    const auto position = static_cast<size_t>(piece) * per_piece + work;
    part.add(all.works[position], all.peers[position]);
  }
  return part;
}

// Runs `task` on the group's issue queue under the caller's autograd mode (a queued thread does not
// inherit it, and in-place updates of a tensor that requires grad need no_grad); what it returns is
// what wait() waits for after it.
std::shared_future<Exchange> defer(ProcessGroupState& group, const IssuedCollective& issued,
                                   std::function<Exchange()> task) {
  auto promise = std::make_shared<std::promise<Exchange>>();
  auto future = promise->get_future().share();
  const bool inference_mode = c10::InferenceMode::is_enabled();
  group.backend->issue_queue.push(
      [promise, task = std::move(task), inference_mode, transport = transport_of(group), issued] {
        try {
          c10::InferenceMode inference(inference_mode);
          at::NoGradGuard no_grad;
          promise->set_value(task());
        } catch (const std::exception& error) {
          publish_failure(transport, issued, error.what());
          promise->set_exception(std::current_exception());
        } catch (...) {
          promise->set_exception(std::current_exception());
        }
      });
  return future;
}

// A ring all-gather over `ring` (group ranks; this rank at `position`): row i of `chunks` ([K, s]
// bytes) is ring member i's, ours already in place. K-1 steps; each forwards the row received in
// the step before. Waits for all but the last step's messages, which it returns.
Exchange ring_all_gather(const Transport& transport, const IssuedCollective& issued, const std::vector<int64_t>& ring,
                         int64_t position, const at::Tensor& chunks, Traffic traffic) {
  const auto count = static_cast<int64_t>(ring.size());
  const auto next = ring[static_cast<size_t>((position + 1) % count)];
  const auto previous = ring[static_cast<size_t>((position + count - 1) % count)];
  auto row = [&](int64_t index) { return chunks[((index % count) + count) % count]; };
  std::vector<c10::intrusive_ptr<c10d::Work>> receives;
  for (int64_t step = 0; step < count - 1; ++step) {
    receives.push_back(post_receive(transport, row(position - 1 - step), previous, issued.data_tag));
  }
  Exchange sends;
  sends.add(post_send(transport, row(position), next, issued.data_tag, traffic), next);
  for (int64_t step = 1; step < count - 1; ++step) {
    Exchange arrived;
    arrived.add(receives[static_cast<size_t>(step - 1)], previous);
    wait_exchange(transport, issued, arrived);
    sends.add(post_send(transport, row(position - step), next, issued.data_tag, traffic), next);
  }
  Exchange last;
  last.add(receives.back(), previous);
  last.append(std::move(sends));
  return last;
}

// A ring reduce-scatter over `ring`: row i of `rows` ([K, c] elements) is this rank's contribution to
// ring member i's chunk. K-1 steps; each adds this rank's contribution to the partial sum received
// and passes it on. `staging` ([K-1, c], the partials received) ends with this rank's reduced chunk
// in its last row. Waits for everything.
void ring_reduce_scatter(const Transport& transport, const IssuedCollective& issued, const std::vector<int64_t>& ring,
                         int64_t position, const at::Tensor& rows, const at::Tensor& staging, ReduceOp op,
                         Traffic traffic) {
  const auto count = static_cast<int64_t>(ring.size());
  const auto next = ring[static_cast<size_t>((position + 1) % count)];
  const auto previous = ring[static_cast<size_t>((position + count - 1) % count)];
  auto row = [&](int64_t index) { return rows[((index % count) + count) % count]; };
  std::vector<c10::intrusive_ptr<c10d::Work>> receives;
  for (int64_t step = 0; step < count - 1; ++step) {
    receives.push_back(post_receive(transport, as_bytes(staging[step]), previous, issued.data_tag));
  }
  Exchange sends;
  sends.add(post_send(transport, as_bytes(row(position - 1)), next, issued.data_tag, traffic), next);
  for (int64_t step = 0; step < count - 1; ++step) {
    Exchange arrived;
    arrived.add(receives[static_cast<size_t>(step)], previous);
    wait_exchange(transport, issued, arrived);
    accumulate(staging[step], row(position - 2 - step), op);
    if (step < count - 2)
      sends.add(post_send(transport, as_bytes(staging[step]), next, issued.data_tag, traffic), next);
  }
  wait_exchange(transport, issued, sends);
}

// Row `position` of `rows` ([K, c]) <- the reduction of every ring member's row `position`, then
// every row <- its member's reduced row: a ring all-reduce of `rows`, waited for but the last step.
// `staging` ([K-1, c]) holds the partial sums received.
Exchange ring_all_reduce(const Transport& transport, const IssuedCollective& issued, const std::vector<int64_t>& ring,
                         int64_t position, const at::Tensor& rows, const at::Tensor& staging, ReduceOp op,
                         Traffic traffic) {
  const auto count = static_cast<int64_t>(ring.size());
  ring_reduce_scatter(transport, issued, ring, position, rows, staging, op, traffic);
  rows[position].copy_(staging[count - 2]);
  return ring_all_gather(transport, issued, ring, position, as_bytes(rows).view({count, -1}), traffic);
}

// A direct all-reduce of `rows` ([K, c]) among `peers` (this rank's row at `position`, peer p's at
// `position_of(p)`): a reduce-scatter then an all-gather, each an exchange with every peer at once.
// `received` ([K, c]) takes the peers' rows. Waits for the first half; returns the second's messages.
Exchange direct_all_reduce(const Transport& transport, const IssuedCollective& issued,
                           const std::vector<int64_t>& peers, const std::function<int64_t(int64_t)>& position_of,
                           int64_t position, const at::Tensor& rows, const at::Tensor& received, ReduceOp op,
                           Traffic traffic) {
  received[position].copy_(rows[position]);
  auto first = exchange_with(
      transport, issued.data_tag, traffic, peers, [&](int64_t peer) { return as_bytes(rows[position_of(peer)]); },
      [&](int64_t peer) { return as_bytes(received[position_of(peer)]); });
  wait_exchange(transport, issued, first);
  auto own = rows[position];
  reduce_rows_into(own, received, op);
  return exchange_with(
      transport, issued.data_tag, traffic, peers, [&](int64_t) { return as_bytes(own); },
      [&](int64_t peer) { return as_bytes(rows[position_of(peer)]); });
}

// A pooled [a, b, c] tensor of `dtype`, and its bytes (for return_pooled_bytes).
struct Staging {
  at::Tensor bytes;
  at::Tensor tensor;
};
Staging staging(at::IntArrayRef sizes, at::ScalarType dtype) {
  int64_t numel = 1;
  for (const auto size : sizes) numel *= size;
  Staging result;
  result.bytes = pooled_bytes(numel * static_cast<int64_t>(c10::elementSize(dtype)));
  result.tensor = result.bytes.view(dtype).view(sizes);
  return result;
}

// How a two-level schedule cuts each rank's chunk of `chunk` elements: two_level_direct into
// two_level_pieces of them (each piece goes on to the next level once it is ready), the ring across
// machines into one.
struct TwoLevelCut {
  int64_t pieces = 1;
  int64_t piece = 0;
};
TwoLevelCut cut_chunks(CollectiveAlgorithm algorithm, int64_t chunk, int64_t element_size) {
  TwoLevelCut cut;
  cut.pieces = algorithm == CollectiveAlgorithm::kTwoLevelRing ? 1 : two_level_pieces(chunk, element_size);
  cut.piece = chunk / cut.pieces;
  return cut;
}

// The first stage of a two-level reduction of `rows` (every rank's chunk, in group order):
// outgoing[l][p][m] is piece p of the chunk of rank (m, l), this rank's contribution; inside[l] is
// what local rank l sent this one, its own row copied in already.
struct ReduceStaging {
  Staging outgoing;
  Staging inside;
};
ReduceStaging stage_reduction(const TwoLevel& place, const TwoLevelCut& cut, const at::Tensor& rows,
                              at::ScalarType dtype) {
  ReduceStaging staged;
  staged.outgoing = staging({place.per_machine, cut.pieces, place.machines, cut.piece}, dtype);
  staged.outgoing.tensor.copy_(
      rows.view({place.machines, place.per_machine, cut.pieces, cut.piece}).permute({1, 2, 0, 3}));
  staged.inside = staging({place.per_machine, cut.pieces, place.machines, cut.piece}, dtype);
  staged.inside.tensor[place.local].copy_(staged.outgoing.tensor[place.local]);
  return staged;
}

}  // namespace

CollectiveAlgorithm algorithm_for(ProcessGroupState& group, CollectiveOperation operation, int64_t bytes) {
  const int forced = group.forced_algorithm[static_cast<size_t>(operation)];
  if (forced >= 0) return static_cast<CollectiveAlgorithm>(forced);
  const auto& members = *group.members;
  const auto& table = engine_algorithm_table();
  const auto choice = choose_algorithm(table, operation, members.shape, bytes);
  if (debug_enabled()) {
    const auto line = choice.row ? choice.row->line : 0;
    std::lock_guard<std::mutex> lock(group.choices_mutex);
    if (group.printed_choices.emplace(static_cast<int>(operation), line).second) {
      std::string row = "no row of its layout's kind: the default";
      if (choice.row) {
        row = "line " + std::to_string(line) + ": " + to_string(operation) + " " +
              std::to_string(choice.row->machines) + " x " + std::to_string(choice.row->ranks_per_machine) + " up to " +
              (choice.row->max_bytes < 0 ? std::string("any size") : std::to_string(choice.row->max_bytes) + " bytes");
      }
      std::fprintf(stderr,
                   "[rank %lld] fsdp: %s of %lld bytes on group '%s' (%lld machines x %lld ranks): %s (%s, %s)\n",
                   static_cast<long long>(members.global_rank), to_string(operation), static_cast<long long>(bytes),
                   members.name.c_str(), static_cast<long long>(members.shape.machines),
                   static_cast<long long>(members.shape.ranks_per_machine), to_string(choice.algorithm),
                   table.source.c_str(), row.c_str());
    }
  }
  return choice.algorithm;
}

Schedule schedule_all_gather(ProcessGroupState& group, const IssuedCollective& issued, CollectiveAlgorithm algorithm,
                             const at::Tensor& output_bytes, const at::Tensor& input_bytes) {
  const auto transport = transport_of(group);
  const auto& members = *transport.members;
  const int64_t size = members.size;
  const int64_t shard = input_bytes.numel();
  const int64_t rank = members.rank;
  Schedule schedule;
  if (algorithm == CollectiveAlgorithm::kDirect || algorithm == CollectiveAlgorithm::kRing) {
    auto own = output_bytes.narrow(0, rank * shard, shard);
    if (own.data_ptr() != input_bytes.data_ptr()) own.copy_(input_bytes);
    if (algorithm == CollectiveAlgorithm::kDirect) {
      const auto peers = others_after(rank, size, [](int64_t index) { return index; });
      schedule.posted = exchange_with(
          transport, issued.data_tag, Traffic::kAllGather, peers, [&](int64_t) { return input_bytes; },
          [&](int64_t peer) { return output_bytes.narrow(0, peer * shard, shard); });
      return schedule;
    }
    schedule.deferred = defer(group, issued, [transport, issued, output_bytes, size, shard, rank] {
      return ring_all_gather(transport, issued, everyone(size), rank, output_bytes.view({size, shard}),
                             Traffic::kAllGather);
    });
    return schedule;
  }
  // Two levels: across machines first (each rank's shard to the ranks of its local index), then inside
  // the machine (each rank's bundle of M shards to the others), so only (M-1)/M of the buffer leaves a
  // machine. two_level_direct cuts each shard into `pieces` and forwards each piece inside the machine
  // as soon as it has arrived from every machine, so the two levels overlap. bundles[l][p][m] is
  // piece p of the shard of the rank at local index l on machine m.
  const TwoLevel place(members);
  const bool ring = algorithm == CollectiveAlgorithm::kTwoLevelRing;
  const auto cut = cut_chunks(algorithm, shard, 1);
  const int64_t pieces = cut.pieces, piece = cut.piece;
  auto bundles = staging({place.per_machine, pieces, place.machines, piece}, at::kByte);
  auto own = bundles.tensor[place.local];
  own.select(1, place.machine).copy_(input_bytes.view({pieces, piece}));
  Exchange across_receives;
  if (!ring) {
    // Every piece's first level at once, piece by piece: a pair's messages on one slot arrive in order.
    const auto across = place.across();
    for (int64_t index = 0; index < pieces; ++index) {
      for (const auto peer : across) {
        across_receives.add(post_receive(transport, own[index][place.machine_of(peer)], peer, issued.data_tag), peer);
      }
    }
    for (int64_t index = 0; index < pieces; ++index) {
      for (const auto peer : across) {
        schedule.posted.add(post_send(transport, input_bytes.narrow(0, index * piece, piece), peer, issued.data_tag,
                                      Traffic::kAllGather),
                            peer);
      }
    }
    for (int64_t index = 0; index < pieces; ++index) {
      for (const auto peer : place.inside()) {
        schedule.posted.add(
            post_receive(transport, as_bytes(bundles.tensor[place.local_of(peer)][index]), peer, issued.data_tag),
            peer);
      }
    }
  }
  schedule.deferred = defer(
      group, issued,
      [transport, issued, ring, place, pieces, bundles = bundles.tensor,
       across_receives = std::move(across_receives)]() mutable {
        auto own = bundles[place.local];
        if (ring) {
          auto rest =
              ring_all_gather(transport, issued, place.across_ring(), place.machine, own[0], Traffic::kAllGather);
          wait_exchange(transport, issued, rest);
          return exchange_with(
              transport, issued.data_tag, Traffic::kAllGather, place.inside(),
              [&](int64_t) { return as_bytes(own[0]); },
              [&](int64_t peer) { return as_bytes(bundles[place.local_of(peer)][0]); });
        }
        Exchange sends;
        const auto count = static_cast<size_t>(place.machines - 1);
        for (int64_t index = 0; index < pieces; ++index) {
          auto arrived = piece_of(across_receives, index, count);
          wait_exchange(transport, issued, arrived);
          for (const auto peer : place.inside()) {
            sends.add(post_send(transport, as_bytes(own[index]), peer, issued.data_tag, Traffic::kAllGather), peer);
          }
        }
        return sends;
      });
  schedule.finish = [output_bytes, bundles, place, pieces] {
    output_bytes.view({place.machines, place.per_machine, pieces, -1}).copy_(bundles.tensor.permute({2, 0, 1, 3}));
    return_pooled_bytes(bundles.bytes);
  };
  return schedule;
}

Schedule schedule_reduce_scatter(ProcessGroupState& group, const IssuedCollective& issued,
                                 CollectiveAlgorithm algorithm, const at::Tensor& output, const at::Tensor& input,
                                 ReduceOp op, double post_divide) {
  const auto transport = transport_of(group);
  const auto& members = *transport.members;
  const int64_t size = members.size;
  const int64_t chunk = output.numel();
  const int64_t rank = members.rank;
  const auto dtype = input.scalar_type();
  auto rows = input.view({size, chunk});
  auto destination = output.reshape({-1});
  Schedule schedule;
  if (algorithm == CollectiveAlgorithm::kDirect) {
    // Row r of `received` is rank r's chunk for this rank: (N-1)/N of the buffer crosses the wire.
    // From the pool of unit-sized blocks: a fresh buffer costs a page fault per 4 KiB (31 ms for 64 MB
    // here, more than the transfer), and the same sizes recur every step.
    auto received = staging({size, chunk}, dtype);
    received.tensor[rank].copy_(rows[rank]);
    const auto peers = others_after(rank, size, [](int64_t index) { return index; });
    schedule.posted = exchange_with(
        transport, issued.data_tag, Traffic::kReduceScatter, peers, [&](int64_t peer) { return as_bytes(rows[peer]); },
        [&](int64_t peer) { return as_bytes(received.tensor[peer]); });
    schedule.finish = [destination, received, op, post_divide, input] {
      reduce_rows_into(destination, received.tensor, op);
      if (post_divide != 1.0) destination.div_(post_divide);
      return_pooled_bytes(received.bytes);
    };
    return schedule;
  }
  if (algorithm == CollectiveAlgorithm::kRing) {
    auto partials = staging({size - 1, chunk}, dtype);
    schedule.deferred = defer(group, issued, [transport, issued, rows, partials = partials.tensor, size, rank, op] {
      ring_reduce_scatter(transport, issued, everyone(size), rank, rows, partials, op, Traffic::kReduceScatter);
      return Exchange();
    });
    schedule.finish = [destination, partials, post_divide, size] {
      destination.copy_(partials.tensor[size - 2]);
      if (post_divide != 1.0) destination.div_(post_divide);
      return_pooled_bytes(partials.bytes);
    };
    return schedule;
  }
  // Two levels: inside the machine first (local rank l receives every machine's chunks of the ranks of
  // local index l, reduced over the machine), then across machines (each chunk to its owner), so only
  // (M-1)/M of the buffer leaves a machine. The partial sum of a machine travels in the buffer's dtype.
  // two_level_direct cuts each chunk into `pieces` and sends a piece across machines as soon as its
  // machine sum is ready, so the two levels overlap.
  const TwoLevel place(members);
  const int64_t machines = place.machines;
  const bool ring = algorithm == CollectiveAlgorithm::kTwoLevelRing;
  const auto cut = cut_chunks(algorithm, chunk, input.element_size());
  const int64_t pieces = cut.pieces, piece = cut.piece;
  const auto staged = stage_reduction(place, cut, input, dtype);
  const auto outgoing = staged.outgoing, inside = staged.inside;
  auto machine_sum = staging({pieces, machines, piece}, dtype);  // [p][m]: this machine's sum for rank (m, l)
  auto across = staging({pieces, machines, piece}, dtype);       // [p][m]: machine m's sum for this rank
  Exchange inside_receives;
  for (int64_t index = 0; index < pieces; ++index) {
    for (const auto peer : place.inside()) {
      inside_receives.add(
          post_receive(transport, as_bytes(inside.tensor[place.local_of(peer)][index]), peer, issued.data_tag), peer);
    }
  }
  for (int64_t index = 0; index < pieces; ++index) {
    for (const auto peer : place.inside()) {
      schedule.posted.add(post_send(transport, as_bytes(outgoing.tensor[place.local_of(peer)][index]), peer,
                                    issued.data_tag, Traffic::kReduceScatter),
                          peer);
    }
  }
  schedule.deferred =
      defer(group, issued,
            [transport, issued, ring, place, op, pieces, inside = inside.tensor, machine_sum = machine_sum.tensor,
             across = across.tensor, inside_receives = std::move(inside_receives)]() mutable {
              Exchange sends;
              const auto count = static_cast<size_t>(place.per_machine - 1);
              for (int64_t index = 0; index < pieces; ++index) {
                auto arrived = piece_of(inside_receives, index, count);
                wait_exchange(transport, issued, arrived);
                auto sum = machine_sum[index];
                reduce_rows_into(sum.view({-1}), inside.select(1, index).reshape({place.per_machine, -1}), op);
                if (ring) {
                  // The ring's partials land in `across`' first M-1 rows; this rank's chunk in row M-2.
                  ring_reduce_scatter(transport, issued, place.across_ring(), place.machine, sum,
                                      across[index].narrow(0, 0, place.machines - 1), op, Traffic::kReduceScatter);
                  continue;
                }
                across[index][place.machine].copy_(sum[place.machine]);
                sends.append(exchange_with(
                    transport, issued.data_tag, Traffic::kReduceScatter, place.across(),
                    [&](int64_t peer) { return as_bytes(sum[place.machine_of(peer)]); },
                    [&](int64_t peer) { return as_bytes(across[index][place.machine_of(peer)]); }));
              }
              return sends;
            });
  schedule.finish = [destination, outgoing, inside, machine_sum, across, ring, machines, pieces, piece, op,
                     post_divide] {
    for (int64_t index = 0; index < pieces; ++index) {
      auto part = destination.narrow(0, index * piece, piece);
      if (ring) {
        part.copy_(across.tensor[index][machines - 2]);
      } else {
        reduce_rows_into(part, across.tensor[index], op);
      }
    }
    if (post_divide != 1.0) destination.div_(post_divide);
    for (const auto* block : {&outgoing, &inside, &machine_sum, &across}) return_pooled_bytes(block->bytes);
  };
  return schedule;
}

Schedule schedule_all_reduce(ProcessGroupState& group, const IssuedCollective& issued, CollectiveAlgorithm algorithm,
                             const at::Tensor& tensor, ReduceOp op) {
  const auto transport = transport_of(group);
  const auto& members = *transport.members;
  const int64_t size = members.size;
  const int64_t rank = members.rank;
  const int64_t numel = tensor.numel();
  const int64_t chunk = (numel + size - 1) / size;
  const auto dtype = tensor.scalar_type();
  // In place when the buffer divides evenly, else a padded copy (the padding is zeros, which no
  // reduction of the real elements reads).
  Staging padded;
  at::Tensor rows;
  if (numel % size == 0) {
    rows = tensor.view({size, chunk});
  } else {
    padded = staging({size, chunk}, dtype);
    rows = padded.tensor;
    auto flat = rows.view({-1});
    flat.narrow(0, 0, numel).copy_(tensor.reshape({-1}));
    flat.narrow(0, numel, size * chunk - numel).zero_();
  }
  Schedule schedule;
  // Every staging block is taken here, on the caller's thread (the pool polls the blocks in use,
  // whose completion is other collectives' state), and returned by `finish`.
  std::vector<Staging> blocks;
  if (algorithm == CollectiveAlgorithm::kDirect || algorithm == CollectiveAlgorithm::kRing) {
    const bool ring = algorithm == CollectiveAlgorithm::kRing;
    auto received = staging({ring ? size - 1 : size, chunk}, dtype);
    blocks = {received};
    schedule.deferred =
        defer(group, issued, [transport, issued, ring, rows, received = received.tensor, size, rank, op] {
          if (ring)
            return ring_all_reduce(transport, issued, everyone(size), rank, rows, received, op, Traffic::kAllReduce);
          return direct_all_reduce(
              transport, issued, others_after(rank, size, [](int64_t index) { return index; }),
              [](int64_t peer) { return peer; }, rank, rows, received, op, Traffic::kAllReduce);
        });
  } else {
    // Two levels: a two-level reduce-scatter of the padded buffer, an all-reduce of the machines'
    // sums across machines, and an all-gather inside the machine: 2(M-1)/M of the buffer leaves each
    // machine. two_level_direct cuts each chunk into `pieces`, and each piece goes on to its next
    // stage as soon as it is ready, so the stages of different pieces overlap.
    const TwoLevel place(members);
    const int64_t machines = place.machines;
    const bool ring = algorithm == CollectiveAlgorithm::kTwoLevelRing;
    const auto cut = cut_chunks(algorithm, chunk, tensor.element_size());
    const int64_t pieces = cut.pieces, piece = cut.piece;
    // outgoing is reused for the reduced pieces gathered at the end.
    const auto staged = stage_reduction(place, cut, rows, dtype);
    const auto outgoing = staged.outgoing, inside = staged.inside;
    auto machine_sum = staging({pieces, machines, piece}, dtype);
    auto across_received = staging({pieces, ring ? machines - 1 : machines, piece}, dtype);
    blocks = {outgoing, inside, machine_sum, across_received};
    Exchange first;
    for (int64_t index = 0; index < pieces; ++index) {
      for (const auto peer : place.inside()) {
        first.add(post_receive(transport, as_bytes(inside.tensor[place.local_of(peer)][index]), peer, issued.data_tag),
                  peer);
      }
    }
    Exchange first_sends;
    for (int64_t index = 0; index < pieces; ++index) {
      for (const auto peer : place.inside()) {
        first_sends.add(post_send(transport, as_bytes(outgoing.tensor[place.local_of(peer)][index]), peer,
                                  issued.data_tag, Traffic::kAllReduce),
                        peer);
      }
    }
    schedule.deferred = defer(
        group, issued,
        [transport, issued, ring, place, op, pieces, outgoing = outgoing.tensor, inside = inside.tensor,
         machine_sum = machine_sum.tensor, across_received = across_received.tensor, first = std::move(first),
         first_sends = std::move(first_sends)]() mutable {
          const auto across = place.across();
          const auto count = static_cast<size_t>(place.per_machine - 1);
          // Each piece: its machine sum, then its reduce-scatter across machines.
          std::vector<Exchange> reduced(static_cast<size_t>(pieces));
          for (int64_t index = 0; index < pieces; ++index) {
            auto arrived = piece_of(first, index, count);
            wait_exchange(transport, issued, arrived);
            auto sum = machine_sum[index];
            reduce_rows_into(sum.view({-1}), inside.select(1, index).reshape({place.per_machine, -1}), op);
            if (ring) {
              auto rest = ring_all_reduce(transport, issued, place.across_ring(), place.machine, sum,
                                          across_received[index], op, Traffic::kAllReduce);
              wait_exchange(transport, issued, rest);
              continue;
            }
            across_received[index][place.machine].copy_(sum[place.machine]);
            reduced[static_cast<size_t>(index)] = exchange_with(
                transport, issued.data_tag, Traffic::kAllReduce, across,
                [&](int64_t peer) { return as_bytes(sum[place.machine_of(peer)]); },
                [&](int64_t peer) { return as_bytes(across_received[index][place.machine_of(peer)]); });
          }
          // Then its all-gather across machines: machine_sum[p][m] <- the group's sum of rank (m, l)'s piece.
          Exchange later;
          std::vector<Exchange> gathered_across(static_cast<size_t>(pieces));
          for (int64_t index = 0; !ring && index < pieces; ++index) {
            auto [receives, sends] = split_receives(std::move(reduced[static_cast<size_t>(index)]), across.size());
            wait_exchange(transport, issued, receives);
            later.append(std::move(sends));
            auto sum = machine_sum[index];
            auto own = sum[place.machine];
            reduce_rows_into(own, across_received[index], op);
            gathered_across[static_cast<size_t>(index)] = exchange_with(
                transport, issued.data_tag, Traffic::kAllReduce, across, [&](int64_t) { return as_bytes(own); },
                [&](int64_t peer) { return as_bytes(sum[place.machine_of(peer)]); });
          }
          // Then inside the machine again: every rank's reduced pieces to the others, into `outgoing`,
          // whose sends of the first stage are done by then.
          wait_exchange(transport, issued, first_sends);
          auto gathered = outgoing;
          for (int64_t index = 0; index < pieces; ++index) {
            if (!ring) {
              auto [receives, sends] =
                  split_receives(std::move(gathered_across[static_cast<size_t>(index)]), across.size());
              wait_exchange(transport, issued, receives);
              later.append(std::move(sends));
            }
            gathered[place.local][index].copy_(machine_sum[index]);
            later.append(exchange_with(
                transport, issued.data_tag, Traffic::kAllReduce, place.inside(),
                [&](int64_t) { return as_bytes(gathered[place.local][index]); },
                [&](int64_t peer) { return as_bytes(gathered[place.local_of(peer)][index]); }));
          }
          return later;
        });
    const auto gathered = outgoing.tensor;
    schedule.finish = [rows, gathered, machines, per_machine = place.per_machine, pieces] {
      rows.view({machines, per_machine, pieces, -1}).copy_(gathered.permute({2, 0, 1, 3}));
    };
  }
  auto previous = schedule.finish;
  schedule.finish = [previous, padded, tensor, numel, blocks] {
    if (previous) previous();
    if (padded.bytes.defined()) {
      tensor.view({-1}).copy_(padded.tensor.view({-1}).narrow(0, 0, numel));
      return_pooled_bytes(padded.bytes);
    }
    for (const auto& block : blocks) return_pooled_bytes(block.bytes);
  };
  return schedule;
}

}  // namespace fsdp::detail
