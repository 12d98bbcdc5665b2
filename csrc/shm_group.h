// Tensor-parallel ranks on one host: their collectives through one shared-memory segment.
//
// torch.distributed (qspec/parallel/comm.py) sets the group up, names the segment and carries
// everything between hosts; on one host its gloo transport costs 0.1-4 ms per collective on a
// small VM (a socket hop through gloo's I/O thread, which has to win a core from the compute
// threads), against a forward's budget of ~80 us per collective. Here a reduction step is a
// write of this rank's partial sums, a release store of its step counter and a spin on the
// others' counters, like the shared-memory all-reduce paths of vLLM/SGLang/DeepSpeed on CPU.
//
// Ordered sums: step s adds the ranks' partials element by element in rank order, so a row's
// sum never depends on how many rows there are, and every rank gets the same bits.
// Buffers are double-buffered by step parity: a rank writes step s+2's partial only after every
// rank published step s+1, which each does after it finished reading step s.
// A peer that dies (its pid gone or a zombie) or stays silent for `timeout` seconds raises
// PeerLost; the followers' wait for rank 0's next command has no time limit.
#pragma once
#include <atomic>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

namespace qspec {

struct PeerLost : std::runtime_error {
  using std::runtime_error::runtime_error;
};

class ShmGroup {
 public:
  // `create`: rank 0 makes the file (size from the capacities, all in elements); the others map it.
  ShmGroup(const std::string& path, int rank, int world, bool create, std::vector<int64_t> pids,
           int64_t reduce_floats, int64_t logits_floats, int64_t command_ints);
  ~ShmGroup();
  ShmGroup(const ShmGroup&) = delete;
  ShmGroup& operator=(const ShmGroup&) = delete;

  // x[n] := sum over ranks of their x[n], in rank order (n split in chunks of the capacity).
  void reduce(float* x, int64_t n);
  // Rank r's logits rows x [rows, width_r]; rank 0 writes them to out[:, lo_r:lo_r + width_r]
  // (ld: out's row stride) for every r; the others pass out = nullptr.
  void gather(const float* x, int64_t rows, int64_t width, float* out, int64_t ld,
              const std::vector<std::pair<int64_t, int64_t>>& columns);
  // Rank 0: publish a command (n int64s) once every follower has taken the previous one.
  void send(const int64_t* cmd, int64_t n);
  // A follower: wait (sleeping after a short spin, without time limit while rank 0 lives) for
  // the next command; copies it into `out`, returns its length.
  int64_t receive(std::vector<int64_t>& out);
  void set_timeout(double seconds) { timeout_s_ = seconds; }
  int rank() const { return rank_; }
  int world() const { return world_; }
  int64_t command_capacity() const { return cmd_cap_; }

 private:
  struct Control;
  void wait_for(const char* what, int peer, const std::atomic<uint64_t>& word, uint64_t value, bool forever);
  void check_alive(const char* what, int peer) const;
  float* reduce_slot(uint64_t step, int r) const;
  float* logits_slot(int r) const;

  int rank_, world_;
  std::vector<int64_t> pids_;
  int64_t red_cap_, log_cap_, cmd_cap_;
  size_t bytes_ = 0;
  char* base_ = nullptr;
  Control* ctl_ = nullptr;
  uint64_t red_step_ = 0, log_step_ = 0, cmd_step_ = 0;
  double timeout_s_ = 300;
  std::vector<float> sum_;
};

}  // namespace qspec
