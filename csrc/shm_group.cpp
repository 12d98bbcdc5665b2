// Shared-memory collectives of tensor-parallel ranks on one host (shm_group.h).
#include "shm_group.h"

#include <fcntl.h>
#include <linux/futex.h>
#include <sched.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <climits>
#include <cstring>
#include <fstream>
#include <memory>

#include "bindings.h"

namespace py = pybind11;

namespace qspec {

namespace {

constexpr int kMaxWorld = 64;
constexpr uint64_t kMagic = 0x7173706563544d53ull;  // "qspecTMS"
constexpr size_t kAlign = 4096;

struct alignas(64) Word {
  std::atomic<uint64_t> v{0};
};

size_t round_up(size_t n) { return (n + kAlign - 1) / kAlign * kAlign; }

using Clock = std::chrono::steady_clock;

inline double since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#endif
}

}  // namespace

struct ShmGroup::Control {
  uint64_t magic;
  int64_t world;
  Word reduced[kMaxWorld];  // the last reduction step each rank has published
  Word logits[kMaxWorld];   // the last logits chunk each follower has written
  Word logits_read;         // the last logits chunk rank 0 has read
  Word taken[kMaxWorld];    // the last command each follower has taken
  alignas(64) std::atomic<uint32_t> command;  // the last command's number (a futex word)
  int64_t command_len;
};

ShmGroup::ShmGroup(const std::string& path, int rank, int world, bool create, std::vector<int64_t> pids,
                   int64_t reduce_floats, int64_t logits_floats, int64_t command_ints)
    : rank_(rank), world_(world), pids_(std::move(pids)), red_cap_(reduce_floats), log_cap_(logits_floats),
      cmd_cap_(command_ints) {
  if (world < 2 || world > kMaxWorld || rank < 0 || rank >= world || int64_t(pids_.size()) != world)
    throw std::invalid_argument("shm group: bad rank, world or pid list");
  if (red_cap_ < 1 || log_cap_ < 1 || cmd_cap_ < 8) throw std::invalid_argument("shm group: bad capacities");
  bytes_ = round_up(sizeof(Control)) + round_up(2 * world * red_cap_ * sizeof(float)) +
           round_up(world * log_cap_ * sizeof(float)) + round_up(cmd_cap_ * sizeof(int64_t));
  const int fd = create ? ::open(path.c_str(), O_RDWR | O_CREAT | O_EXCL, 0600) : ::open(path.c_str(), O_RDWR);
  if (fd < 0) throw std::runtime_error("shm group: cannot open " + path + ": " + std::strerror(errno));
  if (create) {
    // reserve the pages now: a full /dev/shm fails here, not as SIGBUS in the middle of a forward
    const int err = posix_fallocate(fd, 0, off_t(bytes_));
    if (err) {
      ::close(fd);
      ::unlink(path.c_str());
      throw std::runtime_error("shm group: cannot reserve " + std::to_string(bytes_ >> 20) + " MiB in " + path +
                               ": " + std::strerror(err));
    }
  } else {
    struct stat st;
    if (fstat(fd, &st) != 0 || size_t(st.st_size) != bytes_) {
      ::close(fd);
      throw std::runtime_error("shm group: " + path + " has another size (ranks with different capacities)");
    }
  }
  void* p = mmap(nullptr, bytes_, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  ::close(fd);
  if (p == MAP_FAILED) throw std::runtime_error("shm group: mmap failed: " + std::string(std::strerror(errno)));
  base_ = static_cast<char*>(p);
  ctl_ = reinterpret_cast<Control*>(base_);
  if (create) {
    new (ctl_) Control();
    ctl_->world = world;
    std::atomic_thread_fence(std::memory_order_release);
    ctl_->magic = kMagic;
  } else if (ctl_->magic != kMagic || ctl_->world != world) {
    munmap(base_, bytes_);
    throw std::runtime_error("shm group: " + path + " is not this group's segment");
  }
}

ShmGroup::~ShmGroup() {
  if (base_) munmap(base_, bytes_);
}

float* ShmGroup::reduce_slot(uint64_t step, int r) const {
  float* first = reinterpret_cast<float*>(base_ + round_up(sizeof(Control)));
  return first + (int64_t(step & 1) * world_ + r) * red_cap_;
}

float* ShmGroup::logits_slot(int r) const {
  float* first = reinterpret_cast<float*>(base_ + round_up(sizeof(Control)) +
                                          round_up(2 * world_ * red_cap_ * sizeof(float)));
  return first + int64_t(r) * log_cap_;
}

void ShmGroup::check_alive(const char* what, int peer) const {
  // /proc/<pid>/stat: "pid (comm) S ...": gone, a zombie (Z) or dead (X) = exited
  std::ifstream f("/proc/" + std::to_string(pids_[peer]) + "/stat");
  std::string s((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  const size_t close = s.rfind(')');
  const char state = close != std::string::npos && close + 2 < s.size() ? s[close + 2] : 'X';
  if (s.empty() || state == 'Z' || state == 'X')
    throw PeerLost(std::string("tensor-parallel rank ") + std::to_string(peer) + " (pid " +
                   std::to_string(pids_[peer]) + ") exited during " + what);
}

void ShmGroup::wait_for(const char* what, int peer, const std::atomic<uint64_t>& word, uint64_t value,
                        bool forever) {
  if (word.load(std::memory_order_acquire) >= value) return;
  const auto t0 = Clock::now();
  double last_check = 0;
  for (unsigned i = 1; word.load(std::memory_order_acquire) < value; ++i) {
    cpu_relax();
    if ((i & 255) == 0) {
      const double t = since(t0);
      if (t > 50e-6) sched_yield();  // more ranks than cores: let the one we wait for run
      if (t - last_check > 0.02) {
        last_check = t;
        check_alive(what, peer);
        if (!forever && t > timeout_s_)
          throw PeerLost(std::string("tensor-parallel rank ") + std::to_string(peer) + " did not answer within " +
                         std::to_string(int(timeout_s_)) + " s during " + what);
      }
    }
  }
}

void ShmGroup::reduce(float* x, int64_t n) {
  for (int64_t off = 0; off < n; off += red_cap_) {
    const int64_t c = std::min(red_cap_, n - off);
    const uint64_t step = ++red_step_;
    std::memcpy(reduce_slot(step, rank_), x + off, c * sizeof(float));
    ctl_->reduced[rank_].v.store(step, std::memory_order_release);
    for (int p = 0; p < world_; ++p)
      if (p != rank_) wait_for("a row reduction", p, ctl_->reduced[p].v, step, false);
    float* out = x + off;
    const float* s0 = reduce_slot(step, 0);
    const float* s1 = reduce_slot(step, 1);
    for (int64_t i = 0; i < c; ++i) out[i] = s0[i] + s1[i];
    for (int r = 2; r < world_; ++r) {
      const float* s = reduce_slot(step, r);
      for (int64_t i = 0; i < c; ++i) out[i] += s[i];
    }
  }
}

void ShmGroup::gather(const float* x, int64_t rows, int64_t width, float* out, int64_t ld,
                      const std::vector<std::pair<int64_t, int64_t>>& columns) {
  if (int64_t(columns.size()) != world_) throw std::invalid_argument("shm group: one column range per rank");
  int64_t widest = 1;
  for (const auto& c : columns) widest = std::max(widest, c.second - c.first);
  if (columns[rank_].second - columns[rank_].first != width) throw std::invalid_argument("shm group: width");
  const int64_t chunk = std::max<int64_t>(1, log_cap_ / widest);
  if (chunk * widest > log_cap_) throw std::invalid_argument("shm group: logits capacity below one row");
  for (int64_t r0 = 0; r0 < rows; r0 += chunk) {
    const int64_t nr = std::min(chunk, rows - r0);
    const uint64_t step = ++log_step_;
    if (rank_ != 0) {
      wait_for("the logits gather", 0, ctl_->logits_read.v, step - 1, false);  // rank 0 read the last chunk
      std::memcpy(logits_slot(rank_), x + r0 * width, nr * width * sizeof(float));
      ctl_->logits[rank_].v.store(step, std::memory_order_release);
      continue;
    }
    for (int64_t r = 0; r < nr; ++r)
      std::memcpy(out + (r0 + r) * ld + columns[0].first, x + (r0 + r) * width, width * sizeof(float));
    for (int p = 1; p < world_; ++p) {
      wait_for("the logits gather", p, ctl_->logits[p].v, step, false);
      const int64_t w = columns[p].second - columns[p].first;
      const float* src = logits_slot(p);
      for (int64_t r = 0; r < nr; ++r)
        std::memcpy(out + (r0 + r) * ld + columns[p].first, src + r * w, w * sizeof(float));
    }
    ctl_->logits_read.v.store(step, std::memory_order_release);
  }
}

void ShmGroup::send(const int64_t* cmd, int64_t n) {
  if (rank_ != 0) throw std::logic_error("shm group: only rank 0 sends commands");
  if (n > cmd_cap_) throw std::invalid_argument("shm group: command longer than the capacity");
  for (int p = 1; p < world_; ++p) wait_for("a command", p, ctl_->taken[p].v, cmd_step_, false);
  int64_t* buf = reinterpret_cast<int64_t*>(base_ + bytes_ - round_up(cmd_cap_ * sizeof(int64_t)));
  std::memcpy(buf, cmd, n * sizeof(int64_t));
  ctl_->command_len = n;
  ++cmd_step_;
  ctl_->command.store(uint32_t(cmd_step_), std::memory_order_release);
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(&ctl_->command), FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0);
}

int64_t ShmGroup::receive(std::vector<int64_t>& out) {
  const uint32_t want = uint32_t(cmd_step_ + 1), seen = uint32_t(cmd_step_);
  const auto t0 = Clock::now();
  for (unsigned i = 1; ctl_->command.load(std::memory_order_acquire) != want; ++i) {
    // the next forward follows within rank 0's controller step (~0.1-1 ms of Python): spin, as a
    // futex wake-up costs tens of microseconds (more on a VM) and delays every forward by it
    if (since(t0) < 2e-3) {
      cpu_relax();
      continue;
    }
    const timespec ts{0, 50 * 1000 * 1000};  // then sleep, looking at rank 0 every 50 ms
    syscall(SYS_futex, reinterpret_cast<uint32_t*>(&ctl_->command), FUTEX_WAIT, seen, &ts, nullptr, 0);
    if (ctl_->command.load(std::memory_order_acquire) != want) check_alive("the wait for rank 0's next command", 0);
  }
  const int64_t n = ctl_->command_len;
  const int64_t* buf = reinterpret_cast<const int64_t*>(base_ + bytes_ - round_up(cmd_cap_ * sizeof(int64_t)));
  out.assign(buf, buf + n);
  ++cmd_step_;
  ctl_->taken[rank_].v.store(cmd_step_, std::memory_order_release);
  return n;
}

void bind_shm_group(py::module_& m) {
  py::register_exception<PeerLost>(m, "PeerLost", PyExc_RuntimeError);
  py::class_<ShmGroup, std::shared_ptr<ShmGroup>>(m, "ShmGroup",
                                                  "Collectives of tensor-parallel ranks on one host (shm_group.h)")
      .def(py::init<const std::string&, int, int, bool, std::vector<int64_t>, int64_t, int64_t, int64_t>(),
           py::arg("path"), py::arg("rank"), py::arg("world"), py::arg("create"), py::arg("pids"),
           py::arg("reduce_floats"), py::arg("logits_floats"), py::arg("command_ints"))
      .def("set_timeout", &ShmGroup::set_timeout, py::arg("seconds"))
      .def_property_readonly("command_capacity", &ShmGroup::command_capacity)
      .def("reduce", [](ShmGroup& g, py::array_t<float, py::array::c_style> x) {
        float* p = x.mutable_data();
        py::gil_scoped_release release;
        g.reduce(p, x.size());
      }, py::arg("x"), "x := the sum over ranks of x, in rank order (in place)")
      .def("gather", [](ShmGroup& g, py::array_t<float, py::array::c_style> x, py::object out,
                        std::vector<std::pair<int64_t, int64_t>> columns) {
        if (x.ndim() != 2) throw std::invalid_argument("logits must be [rows, width]");
        float* o = nullptr;
        int64_t ld = 0;
        if (!out.is_none()) {
          auto a = out.cast<py::array_t<float, py::array::c_style>>();
          if (a.ndim() != 2 || a.shape(0) < x.shape(0)) throw std::invalid_argument("out must be [rows, vocab]");
          for (const auto& c : columns)
            if (c.first < 0 || c.second > a.shape(1) || c.first > c.second)
              throw std::invalid_argument("column range outside out");
          o = a.mutable_data();
          ld = a.shape(1);
        }
        py::gil_scoped_release release;
        g.gather(x.data(), x.shape(0), x.shape(1), o, ld, columns);
      }, py::arg("x"), py::arg("out"), py::arg("columns"))
      .def("send", [](ShmGroup& g, py::array_t<int64_t, py::array::c_style | py::array::forcecast> cmd) {
        const int64_t* p = cmd.data();
        py::gil_scoped_release release;
        g.send(p, cmd.size());
      }, py::arg("command"))
      .def("receive", [](ShmGroup& g) {
        std::vector<int64_t> v;
        {
          py::gil_scoped_release release;
          g.receive(v);
        }
        py::array_t<int64_t> out(int64_t(v.size()));
        std::memcpy(out.mutable_data(), v.data(), v.size() * sizeof(int64_t));
        return out;
      });
}

}  // namespace qspec
