// sinkax's PJRT plugin: a forwarder over another PJRT C API plugin.
//
// GetPjrtApi() dlopens the inner plugin configured by sinkax_pjrt_configure(), copies its PJRT_Api
// table (by the inner struct_size, so slots newer than this header pass through) and replaces a
// few entries to
//   * count host<->device interactions (launches, transfers and their bytes, compiles);
//   * present a platform of its own name, optionally as a discrete device: Buffer_IsOnCpu=false,
//     host buffers always copied, never aliased;
//   * optionally charge an emulated cost model: a launch cost per execute, and latency + bytes /
//     bandwidth per transfer (host->device ones queued on one copy engine), completed
//     asynchronously;
//   * launch asynchronously, as a device stream does, also when inputs are donated (see Execute);
//   * report each device's live and peak bytes of buffers (Device_MemoryStats, and
//     sinkax_pjrt_memory for Python);
//   * on a discrete device over XLA:CPU, copy large host buffers into device memory it keeps for
//     reuse, as a device's allocator does (see Pool).
//
// Only device memory counts: a buffer in one of a device's host memory kinds (pinned_host,
// unpinned_host) is host memory, and a copy between it and device memory is the transfer.
//
// Cost model (all times on the host's steady clock):
//   host->device: the copy is made during the call (the data really moves), the buffer's ready
//     event fires at  done = max(now, copy_engine_free) + latency + bytes / bandwidth,  and the copy
//     engine is busy until then. The host does not wait.
//   execute: the host waits until every input buffer has arrived, then spends the launch cost,
//     then launches the inner executable, which computes at this CPU's speed, asynchronously:
//     the call returns before its compute ends, the outputs' events fire when it does.
//   device->host: the read-back event fires latency + bytes / bandwidth after the inner copy is
//     done.
// Events whose completion is delayed are wrapped; a timer thread runs their callbacks on time.

#include <dlfcn.h>

#include <algorithm>
#include <cctype>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstddef>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <mutex>
#include <queue>
#include <string>
#include <thread>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "pjrt_c_api.h"

namespace {

using Clock = std::chrono::steady_clock;
using Nanos = std::chrono::nanoseconds;

// ---- configuration ---------------------------------------------------------------------------
struct Config {
  std::string inner_path;
  std::string platform_name;
  bool discrete = false;  // present buffers as device memory: never on the CPU, always copied
};
Config config;

struct Costs {
  double launch_s = 0, h2d_latency_s = 0, h2d_bytes_per_s = 0, d2h_latency_s = 0,
         d2h_bytes_per_s = 0;
};
std::mutex costs_mutex;
Costs costs;
std::atomic<bool> costs_on{false};

Costs current_costs() {
  std::lock_guard<std::mutex> lock(costs_mutex);
  return costs;
}

Nanos transfer_time(double latency_s, double bytes_per_s, uint64_t bytes) {
  double seconds = latency_s + (bytes_per_s > 0 ? bytes / bytes_per_s : 0.0);
  return std::chrono::duration_cast<Nanos>(std::chrono::duration<double>(seconds));
}

// ---- counters ----------------------------------------------------------------------------------
enum Counter { kLaunches, kH2D, kH2DBytes, kD2H, kD2HBytes, kCompiles, kNumCounters };
std::atomic<uint64_t> counters[kNumCounters];

// ---- the inner plugin ----------------------------------------------------------------------------
const PJRT_Api* inner = nullptr;
PJRT_Api* api = nullptr;  // what jax sees: the inner table with a few entries replaced

// Waits until `when`: sleeps most of the way, spins the last ~100 us (sleep overshoots by ~60 us).
void wait_until(Clock::time_point when) {
  const auto slack = std::chrono::microseconds(150);
  auto now = Clock::now();
  if (when - now > slack) std::this_thread::sleep_until(when - slack);
  while (Clock::now() < when) std::this_thread::yield();
}

// ---- modelled readiness of device buffers --------------------------------------------------
std::mutex timeline_mutex;
// A buffer whose data arrives later than the inner plugin makes it: at `not_before` at the
// earliest, and `after_inner` after the inner buffer is ready (a read-back's cost, counted from
// the compute that makes its source).
struct Arrival {
  Clock::time_point not_before{};
  Nanos after_inner{0};
  bool pending() const { return not_before > Clock::now() || after_inner > Nanos(0); }
};
std::unordered_map<PJRT_Buffer*, Arrival> arrives;  // buffers still "in flight"
Clock::time_point h2d_engine_free;

Arrival arrival(PJRT_Buffer* buffer) {
  std::lock_guard<std::mutex> lock(timeline_mutex);
  auto it = arrives.find(buffer);
  return it == arrives.end() ? Arrival{} : it->second;
}

// ---- delayed events ----------------------------------------------------------------------------
// A wrapped event is ready when the inner event is and, after that, `delay` has passed and
// `not_before` is reached.
struct DelayedEvent {
  DelayedEvent(PJRT_Event* inner, Clock::time_point not_before, Nanos delay)
      : inner(inner), not_before(not_before), delay(delay) {}
  PJRT_Event* const inner;
  const Clock::time_point not_before;
  const Nanos delay;
  std::mutex mutex;
  bool inner_done = false;
  Clock::time_point inner_done_at;

  // When the event is ready, counting from the first time the inner one was seen done.
  Clock::time_point mark_inner_done() {
    std::lock_guard<std::mutex> lock(mutex);
    if (!inner_done) inner_done = true, inner_done_at = Clock::now();
    return std::max(not_before, inner_done_at + delay);
  }
};
std::mutex events_mutex;
std::unordered_set<PJRT_Event*> delayed_events;

DelayedEvent* as_delayed(PJRT_Event* event) {
  std::lock_guard<std::mutex> lock(events_mutex);
  return delayed_events.count(event) ? reinterpret_cast<DelayedEvent*>(event) : nullptr;
}

PJRT_Event* delay_event(PJRT_Event* inner_event, Clock::time_point not_before, Nanos delay) {
  auto* event = new DelayedEvent(inner_event, not_before, delay);
  auto* handle = reinterpret_cast<PJRT_Event*>(event);
  std::lock_guard<std::mutex> lock(events_mutex);
  delayed_events.insert(handle);
  return handle;
}

// Runs callbacks at their time, in time order, on one thread (started on first use, never ended:
// it must outlive every event, including at process exit).
class Timer {
 public:
  void at(Clock::time_point when, std::function<void()> fn) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      queue_.push({when, seq_++, std::move(fn)});
      if (!started_) started_ = true, std::thread([this] { run(); }).detach();
    }
    wake_.notify_one();
  }

 private:
  struct Item {
    Clock::time_point when;
    uint64_t seq;
    std::function<void()> fn;
    bool operator>(const Item& o) const { return when != o.when ? when > o.when : seq > o.seq; }
  };
  void run() {
    const auto slack = std::chrono::microseconds(150);
    std::unique_lock<std::mutex> lock(mutex_);
    for (;;) {
      wake_.wait(lock, [this] { return !queue_.empty(); });
      auto when = queue_.top().when;
      if (when - Clock::now() > slack) {
        wake_.wait_until(lock, when - slack);  // or until an earlier item arrives
        continue;
      }
      if (Clock::now() < when) {
        lock.unlock();
        wait_until(when);
        lock.lock();
        continue;
      }
      auto item = queue_.top();
      queue_.pop();
      lock.unlock();
      item.fn();
      lock.lock();
    }
  }
  std::mutex mutex_;
  std::condition_variable wake_;
  std::priority_queue<Item, std::vector<Item>, std::greater<Item>> queue_;
  uint64_t seq_ = 0;
  bool started_ = false;
};
Timer* timer = new Timer;  // leaked on purpose, see Timer

// ---- helpers -------------------------------------------------------------------------------------
uint64_t element_bits(PJRT_Buffer_Type type) {
  switch (type) {
    case PJRT_Buffer_Type_PRED:
    case PJRT_Buffer_Type_S8:
    case PJRT_Buffer_Type_U8:
    case PJRT_Buffer_Type_F8E5M2:
    case PJRT_Buffer_Type_F8E4M3FN:
    case PJRT_Buffer_Type_F8E4M3B11FNUZ:
    case PJRT_Buffer_Type_F8E5M2FNUZ:
    case PJRT_Buffer_Type_F8E4M3FNUZ:
    case PJRT_Buffer_Type_F8E4M3:
    case PJRT_Buffer_Type_F8E3M4:
    case PJRT_Buffer_Type_F8E8M0FNU:
      return 8;
    case PJRT_Buffer_Type_S16:
    case PJRT_Buffer_Type_U16:
    case PJRT_Buffer_Type_F16:
    case PJRT_Buffer_Type_BF16:
      return 16;
    case PJRT_Buffer_Type_S32:
    case PJRT_Buffer_Type_U32:
    case PJRT_Buffer_Type_F32:
      return 32;
    case PJRT_Buffer_Type_S64:
    case PJRT_Buffer_Type_U64:
    case PJRT_Buffer_Type_F64:
    case PJRT_Buffer_Type_C64:
      return 64;
    case PJRT_Buffer_Type_C128:
      return 128;
    case PJRT_Buffer_Type_S4:
    case PJRT_Buffer_Type_U4:
    case PJRT_Buffer_Type_F4E2M1FN:
      return 4;
    case PJRT_Buffer_Type_S2:
    case PJRT_Buffer_Type_U2:
      return 2;
    default:
      return 0;
  }
}

// An inner error the forwarder handles itself.
void forget(PJRT_Error* error) {
  PJRT_Error_Destroy_Args destroy{PJRT_Error_Destroy_Args_STRUCT_SIZE, nullptr, error};
  inner->PJRT_Error_Destroy(&destroy);
}

// ---- device memory: live and peak bytes per device --------------------------------------------
// Counted when a buffer is made (a host transfer, an execution's output) and when jax deletes or
// destroys it (or an execution donates it); the memory of a buffer still read by a pending
// execution is counted free from then on.
struct Usage {
  int64_t live = 0, peak = 0;
};
std::mutex memory_mutex;
std::unordered_map<PJRT_Buffer*, std::pair<PJRT_Device*, int64_t>> buffer_bytes;
std::unordered_map<PJRT_Device*, Usage> usage;
Usage total;  // every device together

PJRT_Device* device_of(PJRT_Buffer* buffer) {
  PJRT_Buffer_Device_Args args{PJRT_Buffer_Device_Args_STRUCT_SIZE, nullptr, buffer, nullptr};
  PJRT_Error* error = inner->PJRT_Buffer_Device(&args);
  if (error) {
    forget(error);
    return nullptr;
  }
  return args.device;
}

void track(PJRT_Buffer* buffer, int64_t bytes) {
  PJRT_Device* device = device_of(buffer);
  std::lock_guard<std::mutex> lock(memory_mutex);
  buffer_bytes[buffer] = {device, bytes};
  for (Usage* u : {&usage[device], &total}) {
    u->live += bytes;
    u->peak = std::max(u->peak, u->live);
  }
}

void untrack(PJRT_Buffer* buffer) {
  std::lock_guard<std::mutex> lock(memory_mutex);
  auto it = buffer_bytes.find(buffer);
  if (it == buffer_bytes.end()) return;
  usage[it->second.first].live -= it->second.second;
  total.live -= it->second.second;
  buffer_bytes.erase(it);
}

// Whether `memory` is device memory, not one of the host memory kinds a device offers
// (pinned_host, unpinned_host: named *_host): only device memory is counted and charged.
// A plugin that does not say is taken to have device memory only.
bool is_device_memory(PJRT_Memory* memory) {
  if (!api->PJRT_Memory_Kind) return true;
  PJRT_Memory_Kind_Args kind{PJRT_Memory_Kind_Args_STRUCT_SIZE, nullptr, memory, nullptr, 0};
  if (PJRT_Error* error = inner->PJRT_Memory_Kind(&kind)) {
    forget(error);
    return true;
  }
  std::string name(kind.kind, kind.kind_size);  // "device"; a plugin may name its own otherwise
  const std::string host = "_host";  // pinned_host, unpinned_host
  return name.size() < host.size() || name.compare(name.size() - host.size(), host.size(), host);
}

// Whether `buffer` lies in device memory (see is_device_memory).
bool in_device_memory(PJRT_Buffer* buffer) {
  // (read from the copied table, zero past the inner plugin's own: it may predate these slots)
  if (!api->PJRT_Buffer_Memory) return true;
  PJRT_Buffer_Memory_Args memory{PJRT_Buffer_Memory_Args_STRUCT_SIZE, nullptr, buffer, nullptr};
  if (PJRT_Error* error = inner->PJRT_Buffer_Memory(&memory)) {
    forget(error);
    return true;
  }
  return is_device_memory(memory.memory);
}

// The bytes of `buffer`'s data, from its shape (asking a pending buffer its size would wait).
uint64_t byte_size(PJRT_Buffer* buffer) {
  PJRT_Buffer_Dimensions_Args dims{PJRT_Buffer_Dimensions_Args_STRUCT_SIZE, nullptr, buffer,
                                   nullptr, 0};
  PJRT_Buffer_ElementType_Args type{PJRT_Buffer_ElementType_Args_STRUCT_SIZE, nullptr, buffer,
                                    PJRT_Buffer_Type_INVALID};
  PJRT_Error* error = inner->PJRT_Buffer_Dimensions(&dims);
  if (!error) error = inner->PJRT_Buffer_ElementType(&type);
  if (error) {
    forget(error);
    return 0;
  }
  uint64_t elements = 1;
  for (size_t i = 0; i < dims.num_dims; ++i) elements *= static_cast<uint64_t>(dims.dims[i]);
  return (elements * element_bits(type.type) + 7) / 8;
}

bool is_deleted(PJRT_Buffer* buffer) {
  PJRT_Buffer_IsDeleted_Args args{PJRT_Buffer_IsDeleted_Args_STRUCT_SIZE, nullptr, buffer, false};
  PJRT_Error* error = inner->PJRT_Buffer_IsDeleted(&args);
  if (!error) return args.is_deleted;
  forget(error);
  return false;
}

// ---- executables: their outputs, and which inputs they donate -------------------------------
// XLA:CPU's plugin waits, inside Execute, for a donated input that an earlier execution has not
// finished computing: a donating loop would then launch one step at a time, as no device stream
// does. So an executable's donated inputs are learned at its first execution (the inputs it
// deleted), and from then on it runs with no input donated, after which sinkax deletes those
// inputs itself: the launch returns at once, the inputs' memory is freed once the execution
// that reads them is done, and jax sees them donated as before.
struct ExecutableInfo {
  std::vector<int64_t> output_bytes;  // of each output, on one device
  bool probed = false;
  std::vector<bool> donated;  // by argument index
};
std::mutex executables_mutex;
std::unordered_map<PJRT_LoadedExecutable*, ExecutableInfo> executables;

// The bytes of each output of `loaded` on one device, from its compiled shapes (asking a pending
// output buffer its size would wait for its computation). Empty if the inner plugin cannot say.
std::vector<int64_t> output_bytes(PJRT_LoadedExecutable* loaded) {
  PJRT_LoadedExecutable_GetExecutable_Args get{
      PJRT_LoadedExecutable_GetExecutable_Args_STRUCT_SIZE, nullptr, loaded, nullptr};
  if (PJRT_Error* error = inner->PJRT_LoadedExecutable_GetExecutable(&get)) {
    forget(error);
    return {};
  }
  std::vector<int64_t> bytes;
  PJRT_Executable_OutputElementTypes_Args types{
      PJRT_Executable_OutputElementTypes_Args_STRUCT_SIZE, nullptr, get.executable, nullptr, 0};
  PJRT_Executable_OutputDimensions_Args dims{PJRT_Executable_OutputDimensions_Args_STRUCT_SIZE,
                                             nullptr, get.executable, 0, nullptr, nullptr};
  PJRT_Error* error = inner->PJRT_Executable_OutputElementTypes(&types);
  if (!error) error = inner->PJRT_Executable_OutputDimensions(&dims);
  if (error) {
    forget(error);
  } else if (dims.num_outputs == types.num_output_types) {
    const int64_t* dim = dims.dims;
    for (size_t o = 0; o < dims.num_outputs; ++o) {
      uint64_t elements = 1;
      for (size_t k = 0; k < dims.dim_sizes[o]; ++k) elements *= static_cast<uint64_t>(*dim++);
      bytes.push_back(static_cast<int64_t>((elements * element_bits(types.output_types[o]) + 7) / 8));
    }
  }
  PJRT_Executable_Destroy_Args free_it{PJRT_Executable_Destroy_Args_STRUCT_SIZE, nullptr,
                                       get.executable};
  inner->PJRT_Executable_Destroy(&free_it);
  return bytes;
}

// ---- device memory kept for host->device copies ------------------------------------------------
// The inner XLA:CPU allocates every buffer afresh, and for a large one the C library maps new
// pages: the copy into it faults once per 4 KiB page (every page of every chunk a sink moves), CPU
// time that no device's transfer costs the host -- a device's allocator hands back memory it
// already holds. So on a discrete device a large host buffer is copied into memory of the
// plugin's own, kept once its buffer is gone for the next copy of the same size, and the inner
// plugin makes a view of it (PJRT_Client_CreateViewOfDeviceBuffer), which hands the memory back
// when the buffer and every execution reading it are done.
constexpr size_t kPooledFrom = 64 << 10;  // smaller: the C library's heap reuses its memory
constexpr size_t kPoolKeeps = size_t{1} << 30;  // bytes of freed memory kept at most
constexpr size_t kPoolAlign = 64;  // XLA:CPU takes memory so aligned as a buffer

class Pool {
 public:
  void* take(size_t bytes) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      auto it = free_.find(bytes);
      if (it != free_.end() && !it->second.empty()) {
        void* memory = it->second.back();
        it->second.pop_back();
        kept_ -= bytes;
        ++reuses_;
        return memory;
      }
    }
    return std::aligned_alloc(kPoolAlign, (bytes + kPoolAlign - 1) / kPoolAlign * kPoolAlign);
  }
  void give(void* memory, size_t bytes) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (kept_ + bytes <= kPoolKeeps) {
        free_[bytes].push_back(memory);
        kept_ += bytes;
        return;
      }
    }
    std::free(memory);
  }
  uint64_t reuses() {
    std::lock_guard<std::mutex> lock(mutex_);
    return reuses_;
  }

 private:
  std::mutex mutex_;
  std::unordered_map<size_t, std::vector<void*>> free_;  // by size
  size_t kept_ = 0;
  uint64_t reuses_ = 0;  // copies made into memory kept
};
Pool* pool = new Pool;  // leaked on purpose: buffers may be destroyed as the process exits

// Whether the inner plugin's device memory is host memory, as XLA:CPU's (platform "cpu"): only
// then is memory of the forwarder's own device memory to it (over a GPU's plugin it is not).
bool inner_memory_is_host(PJRT_Client* client) {
  static const bool is_host = [client] {  // one inner plugin: every client's platform alike
    PJRT_Client_PlatformName_Args name{PJRT_Client_PlatformName_Args_STRUCT_SIZE, nullptr, client,
                                       nullptr, 0};
    if (PJRT_Error* error = inner->PJRT_Client_PlatformName(&name)) {
      forget(error);
      return false;
    }
    return std::string(name.platform_name, name.platform_name_size) == "cpu";
  }();
  return is_host;
}

// The bytes of the host buffer `args` copies if the pool takes the copy, else 0: the pool takes a
// discrete device's copies of kPooledFrom bytes or more, dense, row-major, of whole-byte elements,
// into device memory, with no device layout asked for, where that memory is host memory.
size_t pooled_bytes(const PJRT_Client_BufferFromHostBuffer_Args* args) {
  if (!config.discrete || !api->PJRT_Client_CreateViewOfDeviceBuffer || args->device_layout) return 0;
  uint64_t bits = element_bits(args->type);
  if (bits == 0 || bits % 8) return 0;
  size_t bytes = bits / 8;
  bool strided = args->byte_strides && args->num_byte_strides == args->num_dims;
  for (size_t i = args->num_dims; i-- > 0;) {
    if (strided && args->dims[i] > 1 && args->byte_strides[i] != static_cast<int64_t>(bytes)) return 0;
    bytes *= static_cast<size_t>(args->dims[i]);
  }
  if (bytes < kPooledFrom || !inner_memory_is_host(args->client)) return 0;  // (shape first: no call)
  return args->memory && !is_device_memory(args->memory) ? 0 : bytes;
}

// Copies `args`' host buffer into the pool's memory and makes `args->buffer` the inner plugin's
// view of it, `args->done_with_host_buffer` ready (the copy is made); false, and nothing made, if
// the inner plugin does not make the view.
bool copy_into_pool(PJRT_Client_BufferFromHostBuffer_Args* args, size_t bytes) {
  void* memory = pool->take(bytes);
  if (!memory) return false;
  std::memcpy(memory, args->data, bytes);
  PJRT_Client_CreateViewOfDeviceBuffer_Args view{};
  view.struct_size = PJRT_Client_CreateViewOfDeviceBuffer_Args_STRUCT_SIZE;
  view.client = args->client;
  view.device_buffer_ptr = memory;
  view.dims = args->dims;
  view.num_dims = args->num_dims;
  view.element_type = args->type;
  view.device = args->device;
  view.memory = args->memory;
  view.on_delete_callback = [](void* memory, void* bytes) {
    pool->give(memory, reinterpret_cast<size_t>(bytes));
  };
  view.on_delete_callback_arg = reinterpret_cast<void*>(bytes);
  if (PJRT_Error* error = inner->PJRT_Client_CreateViewOfDeviceBuffer(&view)) {
    forget(error);
    pool->give(memory, bytes);
    return false;
  }
  PJRT_Buffer_ReadyEvent_Args ready{PJRT_Buffer_ReadyEvent_Args_STRUCT_SIZE, nullptr, view.buffer,
                                    nullptr};
  if (PJRT_Error* error = inner->PJRT_Buffer_ReadyEvent(&ready)) {
    forget(error);
    PJRT_Buffer_Destroy_Args destroy{PJRT_Buffer_Destroy_Args_STRUCT_SIZE, nullptr, view.buffer};
    inner->PJRT_Buffer_Destroy(&destroy);  // hands the memory back
    return false;
  }
  args->buffer = view.buffer;
  args->done_with_host_buffer = ready.event;
  return true;
}

// ---- replaced entries ------------------------------------------------------------------------
PJRT_Error* PlatformName(PJRT_Client_PlatformName_Args* args) {
  if (config.platform_name.empty()) return inner->PJRT_Client_PlatformName(args);
  args->platform_name = config.platform_name.c_str();
  args->platform_name_size = config.platform_name.size();
  return nullptr;
}

// "CpuDevice(id=0)" becomes "EmuDevice(id=0)" for platform "emu": what jax prints as the device.
std::mutex names_mutex;
std::unordered_map<PJRT_DeviceDescription*, std::string> device_names;

PJRT_Error* DeviceToString(PJRT_DeviceDescription_ToString_Args* args) {
  PJRT_Error* error = inner->PJRT_DeviceDescription_ToString(args);
  if (error || config.platform_name.empty()) return error;
  std::string name(args->to_string, args->to_string_size);
  auto open = name.find("Device(");
  if (open == std::string::npos) return nullptr;
  std::string prefix = config.platform_name;
  prefix[0] = static_cast<char>(std::toupper(static_cast<unsigned char>(prefix[0])));
  std::lock_guard<std::mutex> lock(names_mutex);
  auto& stored = device_names[args->device_description] = prefix + name.substr(open);
  args->to_string = stored.c_str();
  args->to_string_size = stored.size();
  return nullptr;
}

PJRT_Error* IsOnCpu(PJRT_Buffer_IsOnCpu_Args* args) {
  if (!config.discrete) return inner->PJRT_Buffer_IsOnCpu(args);
  args->is_on_cpu = false;
  return nullptr;
}

PJRT_Error* Compile(PJRT_Client_Compile_Args* args) {
  counters[kCompiles].fetch_add(1, std::memory_order_relaxed);
  return inner->PJRT_Client_Compile(args);
}

// `buffer`, just made in device memory from `bytes` of host memory (whose own data is ready at
// `ready`): counted, tracked, and charged to the host->device copy engine.
void arrived_by_h2d(PJRT_Buffer* buffer, uint64_t bytes, Clock::time_point ready = {}) {
  counters[kH2D].fetch_add(1, std::memory_order_relaxed);
  counters[kH2DBytes].fetch_add(bytes, std::memory_order_relaxed);
  track(buffer, static_cast<int64_t>(bytes));
  if (!costs_on.load(std::memory_order_relaxed)) return;
  Costs c = current_costs();
  std::lock_guard<std::mutex> lock(timeline_mutex);
  auto start = std::max({Clock::now(), h2d_engine_free, ready});
  h2d_engine_free = start + transfer_time(c.h2d_latency_s, c.h2d_bytes_per_s, bytes);
  arrives[buffer] = Arrival{h2d_engine_free};
}

PJRT_Error* BufferFromHostBuffer(PJRT_Client_BufferFromHostBuffer_Args* args) {
  if (config.discrete && (args->host_buffer_semantics == PJRT_HostBufferSemantics_kImmutableZeroCopy ||
                          args->host_buffer_semantics == PJRT_HostBufferSemantics_kMutableZeroCopy)) {
    args->host_buffer_semantics = PJRT_HostBufferSemantics_kImmutableOnlyDuringCall;  // a real copy
  }
  if (size_t bytes = pooled_bytes(args); bytes && copy_into_pool(args, bytes)) {
    arrived_by_h2d(args->buffer, bytes);
    return nullptr;
  }
  PJRT_Error* error = inner->PJRT_Client_BufferFromHostBuffer(args);
  if (error) return error;
  // into one of the device's host memory kinds: a copy on the host, no transfer
  if (in_device_memory(args->buffer)) arrived_by_h2d(args->buffer, byte_size(args->buffer));
  return nullptr;
}

// A copy of a buffer to another memory (kind, or device), made by the inner plugin as `dst`:
// into device memory from a host kind, a host->device transfer; out of device memory into a
// host kind, a device->host one (charged as a read-back is); between devices' memories, only
// tracked (no host interaction); between host kinds, nothing.
void copied(PJRT_Buffer* src, PJRT_Buffer* dst) {
  bool from_device = in_device_memory(src), to_device = in_device_memory(dst);
  uint64_t bytes = byte_size(dst);
  auto ready = arrival(src).not_before;
  if (to_device && !from_device) return arrived_by_h2d(dst, bytes, ready);
  if (to_device) {
    track(dst, static_cast<int64_t>(bytes));
    std::lock_guard<std::mutex> lock(timeline_mutex);
    if (ready > Clock::now()) arrives[dst] = Arrival{ready};
    return;
  }
  if (!from_device) return;
  counters[kD2H].fetch_add(1, std::memory_order_relaxed);
  counters[kD2HBytes].fetch_add(bytes, std::memory_order_relaxed);
  if (!costs_on.load(std::memory_order_relaxed)) return;
  Costs c = current_costs();
  std::lock_guard<std::mutex> lock(timeline_mutex);
  auto cost = transfer_time(c.d2h_latency_s, c.d2h_bytes_per_s, bytes);
  arrives[dst] = Arrival{ready + cost, cost};  // after the source's compute, too
}

PJRT_Error* CopyToDevice(PJRT_Buffer_CopyToDevice_Args* args) {
  PJRT_Error* error = inner->PJRT_Buffer_CopyToDevice(args);
  if (!error) copied(args->buffer, args->dst_buffer);
  return error;
}

PJRT_Error* CopyToMemory(PJRT_Buffer_CopyToMemory_Args* args) {
  PJRT_Error* error = inner->PJRT_Buffer_CopyToMemory(args);
  if (!error) copied(args->buffer, args->dst_buffer);
  return error;
}

PJRT_Error* BufferDelete(PJRT_Buffer_Delete_Args* args) {
  untrack(args->buffer);
  return inner->PJRT_Buffer_Delete(args);
}

PJRT_Error* BufferDestroy(PJRT_Buffer_Destroy_Args* args) {
  untrack(args->buffer);
  {
    std::lock_guard<std::mutex> lock(timeline_mutex);
    arrives.erase(args->buffer);
  }
  return inner->PJRT_Buffer_Destroy(args);
}

PJRT_Error* BufferReadyEvent(PJRT_Buffer_ReadyEvent_Args* args) {
  PJRT_Error* error = inner->PJRT_Buffer_ReadyEvent(args);
  auto when = arrival(args->buffer);
  if (!error && when.pending())
    args->event = delay_event(args->event, when.not_before, when.after_inner);
  return error;
}

PJRT_Error* LoadedExecutableDestroy(PJRT_LoadedExecutable_Destroy_Args* args) {
  {
    std::lock_guard<std::mutex> lock(executables_mutex);
    executables.erase(args->executable);
  }
  return inner->PJRT_LoadedExecutable_Destroy(args);
}

// Whether input `index` must stay undonated: jax lists such inputs (e.g. passed twice).
bool kept_by_caller(const PJRT_ExecuteOptions* options, size_t index) {
  if (!options) return false;
  for (size_t k = 0; k < options->num_non_donatable_input_indices; ++k)
    if (options->non_donatable_input_indices[k] == static_cast<int64_t>(index)) return true;
  return false;
}

PJRT_Error* Execute(PJRT_LoadedExecutable_Execute_Args* args) {
  counters[kLaunches].fetch_add(1, std::memory_order_relaxed);
  if (costs_on.load(std::memory_order_relaxed)) {
    Clock::time_point inputs_ready{};
    for (size_t d = 0; d < args->num_devices; ++d)
      for (size_t i = 0; i < args->num_args; ++i)
        inputs_ready = std::max(inputs_ready, arrival(args->argument_lists[d][i]).not_before);
    wait_until(inputs_ready);
    Costs c = current_costs();
    wait_until(Clock::now() + transfer_time(c.launch_s, 0, 0));
  }
  ExecutableInfo info;
  {
    std::lock_guard<std::mutex> lock(executables_mutex);
    info = executables[args->executable];
  }
  bool donates = std::find(info.donated.begin(), info.donated.end(), true) != info.donated.end();
  PJRT_Error* error;
  if (!info.probed || !donates || !args->options) {
    error = inner->PJRT_LoadedExecutable_Execute(args);  // the first run may wait: see above
  } else {
    PJRT_ExecuteOptions options{};
    size_t size = std::min(args->options->struct_size, sizeof(PJRT_ExecuteOptions));
    std::memcpy(&options, args->options, size);
    options.struct_size = size;
    std::vector<int64_t> every(args->num_args);
    for (size_t i = 0; i < every.size(); ++i) every[i] = static_cast<int64_t>(i);
    options.non_donatable_input_indices = every.data();
    options.num_non_donatable_input_indices = every.size();
    PJRT_LoadedExecutable_Execute_Args undonated = *args;
    undonated.options = &options;
    error = inner->PJRT_LoadedExecutable_Execute(&undonated);
  }
  if (error) return error;
  if (!info.probed) {
    info.probed = true;
    info.output_bytes = output_bytes(args->executable);
    info.donated.assign(args->num_args, false);
    for (size_t i = 0; i < args->num_args && args->num_devices > 0; ++i)
      info.donated[i] = is_deleted(args->argument_lists[0][i]);
    std::lock_guard<std::mutex> lock(executables_mutex);
    executables[args->executable] = info;
  }
  for (size_t i = 0; i < info.donated.size() && i < args->num_args; ++i) {
    if (!info.donated[i] || kept_by_caller(args->options, i)) continue;
    for (size_t d = 0; d < args->num_devices; ++d) {
      PJRT_Buffer* donated = args->argument_lists[d][i];
      untrack(donated);
      if (!donates) continue;  // the first run: the inner plugin consumed it already
      PJRT_Buffer_Delete_Args remove{PJRT_Buffer_Delete_Args_STRUCT_SIZE, nullptr, donated};
      if (PJRT_Error* failed = inner->PJRT_Buffer_Delete(&remove)) forget(failed);
    }
  }
  for (size_t d = 0; d < args->num_devices; ++d)
    for (size_t o = 0; o < info.output_bytes.size(); ++o)
      if (PJRT_Buffer* out = args->output_lists[d][o]) track(out, info.output_bytes[o]);
  return nullptr;
}

PJRT_Error* MemoryStats(PJRT_Device_MemoryStats_Args* args) {
  size_t size = std::min(args->struct_size, sizeof(PJRT_Device_MemoryStats_Args));
  size_t head = offsetof(PJRT_Device_MemoryStats_Args, bytes_in_use);
  if (size > head) std::memset(reinterpret_cast<char*>(args) + head, 0, size - head);
  std::lock_guard<std::mutex> lock(memory_mutex);
  Usage u = usage[args->device];
  args->bytes_in_use = u.live;
  args->peak_bytes_in_use = u.peak;
  args->peak_bytes_in_use_is_set = true;
  return nullptr;
}

PJRT_Error* ToHostBuffer(PJRT_Buffer_ToHostBuffer_Args* args) {
  if (args->dst == nullptr) return inner->PJRT_Buffer_ToHostBuffer(args);  // a size query
  if (!in_device_memory(args->src)) {  // a host kind: read once its data has arrived
    auto when = arrival(args->src);
    PJRT_Error* error = inner->PJRT_Buffer_ToHostBuffer(args);
    if (!error && when.pending())
      args->event = delay_event(args->event, when.not_before, when.after_inner);
    return error;
  }
  uint64_t bytes = byte_size(args->src);  // packed, as a transfer to the device counts them
  if (bytes == 0) bytes = args->dst_size;
  counters[kD2H].fetch_add(1, std::memory_order_relaxed);
  counters[kD2HBytes].fetch_add(bytes, std::memory_order_relaxed);
  auto arrived = arrival(args->src).not_before;
  PJRT_Error* error = inner->PJRT_Buffer_ToHostBuffer(args);
  if (error || !costs_on.load(std::memory_order_relaxed)) return error;
  Costs c = current_costs();
  auto cost = transfer_time(c.d2h_latency_s, c.d2h_bytes_per_s, bytes);
  args->event = delay_event(args->event, arrived + cost, cost);
  return nullptr;
}

// ---- events: wrapped ones handled here, the others forwarded --------------------------------
PJRT_Error* EventDestroy(PJRT_Event_Destroy_Args* args) {
  DelayedEvent* event = as_delayed(args->event);
  if (!event) return inner->PJRT_Event_Destroy(args);
  {
    std::lock_guard<std::mutex> lock(events_mutex);
    delayed_events.erase(args->event);
  }
  PJRT_Event_Destroy_Args inner_args = *args;
  inner_args.event = event->inner;
  PJRT_Error* error = inner->PJRT_Event_Destroy(&inner_args);
  delete event;
  return error;
}

PJRT_Error* EventIsReady(PJRT_Event_IsReady_Args* args) {
  DelayedEvent* event = as_delayed(args->event);
  if (!event) return inner->PJRT_Event_IsReady(args);
  PJRT_Event_IsReady_Args inner_args = *args;
  inner_args.event = event->inner;
  if (PJRT_Error* error = inner->PJRT_Event_IsReady(&inner_args)) return error;
  args->is_ready = inner_args.is_ready && Clock::now() >= event->mark_inner_done();
  return nullptr;
}

PJRT_Error* EventError(PJRT_Event_Error_Args* args) {
  DelayedEvent* event = as_delayed(args->event);
  if (!event) return inner->PJRT_Event_Error(args);
  PJRT_Event_Error_Args inner_args = *args;
  inner_args.event = event->inner;
  return inner->PJRT_Event_Error(&inner_args);
}

PJRT_Error* EventAwait(PJRT_Event_Await_Args* args) {
  DelayedEvent* event = as_delayed(args->event);
  if (!event) return inner->PJRT_Event_Await(args);
  PJRT_Event_Await_Args inner_args = *args;
  inner_args.event = event->inner;
  PJRT_Error* error = inner->PJRT_Event_Await(&inner_args);
  wait_until(event->mark_inner_done());
  return error;
}

// The event may be destroyed before its callback runs: the callback keeps its own copy of the times.
struct PendingCallback {
  Clock::time_point not_before;
  Nanos delay;
  PJRT_Event_OnReadyCallback callback;
  void* user_arg;
};

void OnInnerReady(PJRT_Error* error, void* user_arg) {
  auto* pending = static_cast<PendingCallback*>(user_arg);
  auto when = std::max(pending->not_before, Clock::now() + pending->delay);
  auto fire = [pending, error] {
    pending->callback(error, pending->user_arg);
    delete pending;
  };
  if (Clock::now() >= when) return fire();
  timer->at(when, fire);
}

PJRT_Error* EventOnReady(PJRT_Event_OnReady_Args* args) {
  DelayedEvent* event = as_delayed(args->event);
  if (!event) return inner->PJRT_Event_OnReady(args);
  PJRT_Event_OnReady_Args inner_args = *args;
  inner_args.event = event->inner;
  inner_args.callback = OnInnerReady;
  inner_args.user_arg =
      new PendingCallback{event->not_before, event->delay, args->callback, args->user_arg};
  return inner->PJRT_Event_OnReady(&inner_args);
}

}  // namespace

// ---- the C ABI ----------------------------------------------------------------------------------
#define SINKAX_EXPORT __attribute__((visibility("default")))

extern "C" {

// Must be called before GetPjrtApi. Returns 0, or -1 once the plugin is already loaded.
SINKAX_EXPORT int sinkax_pjrt_configure(const char* inner_path, const char* platform_name, int discrete) {
  if (inner) return -1;
  config.inner_path = inner_path;
  config.platform_name = platform_name ? platform_name : "";
  config.discrete = discrete != 0;
  return 0;
}

SINKAX_EXPORT void sinkax_pjrt_set_costs(double launch_s, double h2d_latency_s, double h2d_bytes_per_s,
                           double d2h_latency_s, double d2h_bytes_per_s) {
  std::lock_guard<std::mutex> lock(costs_mutex);
  costs = Costs{launch_s, h2d_latency_s, h2d_bytes_per_s, d2h_latency_s, d2h_bytes_per_s};
  costs_on = launch_s > 0 || h2d_latency_s > 0 || h2d_bytes_per_s > 0 || d2h_latency_s > 0 ||
             d2h_bytes_per_s > 0;
}

// Writes the counters (launches, h2d, h2d_bytes, d2h, d2h_bytes, compiles) into out[0..n).
SINKAX_EXPORT size_t sinkax_pjrt_counters(uint64_t* out, size_t n) {
  size_t count = std::min<size_t>(n, kNumCounters);
  for (size_t i = 0; i < count; ++i) out[i] = counters[i].load();
  return kNumCounters;
}

// The host->device copies made into device memory kept from an earlier one (see Pool).
SINKAX_EXPORT uint64_t sinkax_pjrt_pool_reuses() { return pool->reuses(); }

// Writes (live bytes, peak bytes) of every device together into out[0..2); resets the peaks to
// the live bytes if `reset_peak`.
SINKAX_EXPORT void sinkax_pjrt_memory(int64_t* out, int reset_peak) {
  std::lock_guard<std::mutex> lock(memory_mutex);
  out[0] = total.live;
  out[1] = total.peak;
  if (!reset_peak) return;
  total.peak = total.live;
  for (auto& entry : usage) entry.second.peak = entry.second.live;
}

// The error dlopen/dlsym gave while loading the inner plugin, or "".
static std::string load_error;
SINKAX_EXPORT const char* sinkax_pjrt_load_error() { return load_error.c_str(); }

SINKAX_EXPORT const PJRT_Api* GetPjrtApi() {
  if (api) return api;
  if (config.inner_path.empty()) {
    load_error = "sinkax_pjrt_configure was not called before the plugin was loaded";
    return nullptr;
  }
  void* handle = dlopen(config.inner_path.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (!handle) {
    load_error = dlerror();
    return nullptr;
  }
  auto get = reinterpret_cast<const PJRT_Api* (*)()>(dlsym(handle, "GetPjrtApi"));
  if (!get) {
    load_error = "the inner plugin has no GetPjrtApi: " + config.inner_path;
    return nullptr;
  }
  inner = get();
  // Copied by the inner struct_size: slots newer than this header pass through untouched.
  auto* table = new char[std::max(sizeof(PJRT_Api), inner->struct_size)]();
  std::memcpy(table, inner, inner->struct_size);
  api = reinterpret_cast<PJRT_Api*>(table);
  api->PJRT_Client_PlatformName = PlatformName;
  api->PJRT_Buffer_IsOnCpu = IsOnCpu;
  api->PJRT_DeviceDescription_ToString = DeviceToString;
  api->PJRT_Client_Compile = Compile;
  api->PJRT_Client_BufferFromHostBuffer = BufferFromHostBuffer;
  api->PJRT_Buffer_Destroy = BufferDestroy;
  api->PJRT_Buffer_Delete = BufferDelete;
  api->PJRT_LoadedExecutable_Destroy = LoadedExecutableDestroy;
  api->PJRT_Device_MemoryStats = MemoryStats;
  api->PJRT_Buffer_ReadyEvent = BufferReadyEvent;
  api->PJRT_LoadedExecutable_Execute = Execute;
  api->PJRT_Buffer_ToHostBuffer = ToHostBuffer;
  if (api->PJRT_Buffer_CopyToDevice) api->PJRT_Buffer_CopyToDevice = CopyToDevice;
  if (api->PJRT_Buffer_CopyToMemory) api->PJRT_Buffer_CopyToMemory = CopyToMemory;
  api->PJRT_Event_Destroy = EventDestroy;
  api->PJRT_Event_IsReady = EventIsReady;
  api->PJRT_Event_Error = EventError;
  api->PJRT_Event_Await = EventAwait;
  api->PJRT_Event_OnReady = EventOnReady;
  return api;
}

}  // extern "C"
