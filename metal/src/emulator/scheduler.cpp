// The emulator's scheduler: runs a dispatch's threadgroups on the calling thread and on
// helper threads (one per further host core; threadgroups share nothing but device memory,
// as on the GPU, and `threadgroup` memory is per OS thread), and the threads of one
// threadgroup concurrently as fibers (each with its own stack) that switch
// only at barriers and SIMD-group exchanges. Between two barriers the threads run in
// reverse order of their index, so a kernel that reads a value another thread writes
// without a barrier in between sees a stale value (a missing barrier shows up as a wrong
// result, not silently right). A barrier that some threads never reach while others wait
// is reported as an error, as is a kernel asking for more than it may.
#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "emu.h"

#if !defined(__x86_64__)
#include <ucontext.h>
#endif

namespace mtp_emu {
namespace {

constexpr size_t STACK_BYTES = 64 * 1024;
constexpr uint32_t MAX_THREADS = 1024;

enum class State { Ready, AtBarrier, AtSimdBarrier, Done };

struct Fiber;

// Context switching: hand-written on x86-64 (six callee-saved registers and the stack
// pointer; no system call; the resume address is jumped to, not returned to, which keeps
// the return-address predictor in step), ucontext elsewhere.
#if defined(__x86_64__)
extern "C" void mtp_emu_switch(void** save_sp, void* load_sp);
asm(R"(
    .text
    .globl mtp_emu_switch
    .type mtp_emu_switch, @function
mtp_emu_switch:
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    movq %rsp, (%rdi)
    movq %rsi, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    popq %rcx
    jmpq *%rcx
    .size mtp_emu_switch, .-mtp_emu_switch
)");
struct Context {
    void* sp = nullptr;
};
#else
struct Context {
    ucontext_t uc;
};
#endif

struct Group;

struct Fiber {
    Context ctx;
    // Not zeroed: large blocks come from mmap and pages are touched only as used.
    std::unique_ptr<unsigned char[]> stack;
    State state = State::Done;
    Position pos{};
    Group* group = nullptr;
};

struct Group {
    Invoker invoke = nullptr;
    void* const* args = nullptr;
    std::vector<Fiber> fibers;
    Context scheduler;
    Fiber* current = nullptr;
    uint32_t threads = 0;
    // Two exchange buffers per SIMD-group, used in turn.
    std::vector<unsigned char> scratch;
    std::vector<uint32_t> generation;
    // Per SIMD-group: lanes not returned, lanes waiting at the exchange.
    std::vector<uint32_t> simd_live, simd_waiting;
    std::vector<uint32_t> ready;
    std::string error;
};

thread_local Group* g_group = nullptr;

void fiber_main();

#if defined(__x86_64__)
extern "C" void mtp_emu_fiber_entry() {
    fiber_main();
    std::abort();  // unreachable: fiber_main switches away for good
}

void start_fiber(Fiber& f) {
    unsigned char* top = f.stack.get() + STACK_BYTES;
    uintptr_t aligned = reinterpret_cast<uintptr_t>(top) & ~uintptr_t(15);
    void** sp = reinterpret_cast<void**>(aligned);
    // Below the 16-aligned top: a zero "return address" slot for alignment, the entry
    // (popped by `ret`, leaving the stack as a call would), then six saved registers.
    *--sp = nullptr;
    *--sp = reinterpret_cast<void*>(&mtp_emu_fiber_entry);
    for (int i = 0; i < 6; i++) *--sp = nullptr;
    f.ctx.sp = sp;
}
void switch_to(Context& save, Context& load) { mtp_emu_switch(&save.sp, load.sp); }
#else
void start_fiber(Fiber& f) {
    getcontext(&f.ctx.uc);
    f.ctx.uc.uc_stack.ss_sp = f.stack.get();
    f.ctx.uc.uc_stack.ss_size = STACK_BYTES;
    f.ctx.uc.uc_link = nullptr;
    makecontext(&f.ctx.uc, fiber_main, 0);
}
void switch_to(Context& save, Context& load) { swapcontext(&save.uc, &load.uc); }
#endif

void fiber_main() {
    Group* g = g_group;
    Fiber* f = g->current;
    g->invoke(g->args);
    f->state = State::Done;
    switch_to(f->ctx, g->scheduler);
}

void yield(State s) {
    Group* g = g_group;
    Fiber* f = g->current;
    f->state = s;
    switch_to(f->ctx, g->scheduler);
}

void enter(Group& g, uint32_t i) {
    Fiber& f = g.fibers[i];
    const uint32_t s = i / 32;
    g.current = &f;
    current_position = &f.pos;
    current_scratch = g.scratch.data() + (size_t(s) * 2 + (g.generation[s] & 1u)) * 32 * 16;
    switch_to(g.scheduler, f.ctx);
}

// Runs threadgroup (gx, gy): every thread to completion. Runnable threads wait on a stack;
// a SIMD-group is released when its last live lane reaches the exchange, the threadgroup
// when its last thread reaches the barrier; each release pushes the threads in index
// order, so they run from the highest index down.
bool run_group(Group& g, uint32_t gx, uint32_t gy) {
    const uint32_t n = g.threads, simds = (n + 31) / 32;
    g.ready.clear();
    for (uint32_t t = 0; t < n; t++) {
        Fiber& f = g.fibers[t];
        f.state = State::Ready;
        f.pos = Position{gx, gy, t, n};
        start_fiber(f);
        g.ready.push_back(t);
    }
    for (uint32_t s = 0; s < simds; s++) {
        g.generation[s] = 0;
        g.simd_live[s] = std::min(n, 32 * s + 32) - 32 * s;
        g.simd_waiting[s] = 0;
    }
    uint32_t done = 0, at_barrier = 0;
    g_group = &g;
    while (!g.ready.empty()) {
        const uint32_t i = g.ready.back();
        g.ready.pop_back();
        enter(g, i);
        const uint32_t s = i / 32, lo = 32 * s, hi = std::min(n, lo + 32);
        switch (g.fibers[i].state) {
            case State::Done:
                done++;
                g.simd_live[s]--;
                break;
            case State::AtSimdBarrier:
                g.simd_waiting[s]++;
                break;
            case State::AtBarrier:
                at_barrier++;
                break;
            case State::Ready:
                break;
        }
        if (g.simd_waiting[s] > 0 && g.simd_waiting[s] == g.simd_live[s]) {
            g.simd_waiting[s] = 0;
            g.generation[s]++;
            for (uint32_t t = lo; t < hi; t++)
                if (g.fibers[t].state == State::AtSimdBarrier) {
                    g.fibers[t].state = State::Ready;
                    g.ready.push_back(t);
                }
        }
        if (at_barrier == n) {
            at_barrier = 0;
            for (uint32_t t = 0; t < n; t++) {
                g.fibers[t].state = State::Ready;
                g.ready.push_back(t);
            }
        }
    }
    g.current = nullptr;
    if (done == n) return true;
    char msg[200];
    std::snprintf(msg, sizeof msg,
                  "threadgroup (%u, %u) deadlocked: %u of %u threads returned while the others wait at a "
                  "barrier or SIMD-group exchange they never reach (divergent barrier)",
                  gx, gy, done, n);
    g.error = msg;
    // The waiting fibers are abandoned: the next dispatch starts every fiber afresh.
    return false;
}

// The calling thread's fibers, kept from one dispatch to the next.
Group& group_for(uint32_t threads) {
    thread_local Group g;
    if (g.fibers.size() < threads) {
        g.fibers.resize(threads);
        for (auto& f : g.fibers)
            if (!f.stack) f.stack.reset(new unsigned char[STACK_BYTES]);
    }
    const size_t simds = (threads + 31) / 32;
    g.scratch.assign(simds * 2 * 32 * 16, 0);
    g.generation.assign(simds, 0);
    g.simd_live.assign(simds, 0);
    g.simd_waiting.assign(simds, 0);
    g.threads = threads;
    return g;
}

}  // namespace

__thread const Position* current_position = nullptr;
__thread unsigned char* current_scratch = nullptr;

void threadgroup_barrier() { yield(State::AtBarrier); }

void simdgroup_barrier() { yield(State::AtSimdBarrier); }

}  // namespace mtp_emu

using namespace mtp_emu;

namespace {

// One dispatch: its threadgroups, numbered x + gx * y, taken in turn by whoever runs it.
struct Job {
    Invoker invoke;
    void* const* args;
    uint32_t gx, threads, total;
    std::atomic<uint32_t> next{0};
    // Threads inside `work`; guarded by the pool's mutex.
    uint32_t working = 0;
    // The lowest-numbered threadgroup that failed, and its message (under `failure`): the
    // error a one-thread run, which stops at the first failure, would give.
    std::mutex failure;
    uint32_t failed_group = UINT32_MAX;
    std::string error;
};

void work(Job& job) {
    Group& g = group_for(job.threads);
    g.invoke = job.invoke;
    g.args = job.args;
    for (uint32_t i = job.next.fetch_add(1); i < job.total; i = job.next.fetch_add(1)) {
        if (!run_group(g, i % job.gx, i / job.gx)) {
            std::lock_guard<std::mutex> lock(job.failure);
            if (i < job.failed_group) {
                job.failed_group = i;
                job.error = g.error;
            }
        }
    }
    g_group = nullptr;
}

// Helper threads, one fewer than the host's cores, started at the first dispatch and never
// stopped (the pool is never freed, so no destructor races a helper at exit).
struct Pool {
    std::mutex mutex;
    std::condition_variable wake, finished;
    std::deque<Job*> jobs;
    unsigned helpers = 0;

    Pool() {
        const unsigned cores = std::thread::hardware_concurrency();
        helpers = cores > 1 ? std::min(cores - 1, 63u) : 0;
        for (unsigned i = 0; i < helpers; i++) std::thread([this] { help(); }).detach();
    }

    void help() {
        std::unique_lock<std::mutex> lock(mutex);
        for (;;) {
            wake.wait(lock, [this] { return !jobs.empty(); });
            Job* job = jobs.front();
            if (job->next.load() >= job->total) {
                jobs.pop_front();  // every threadgroup taken: its dispatcher waits for `working`
                continue;
            }
            job->working++;
            lock.unlock();
            work(*job);
            lock.lock();
            if (--job->working == 0) finished.notify_all();
        }
    }

    void run(Job& job) {
        {
            std::lock_guard<std::mutex> lock(mutex);
            jobs.push_back(&job);
        }
        wake.notify_all();
        work(job);
        std::unique_lock<std::mutex> lock(mutex);
        jobs.erase(std::remove(jobs.begin(), jobs.end(), &job), jobs.end());
        finished.wait(lock, [&] { return job.working == 0; });
    }
};

Pool& pool() {
    static Pool* p = new Pool;
    return *p;
}

}  // namespace

// Runs `invoke` over a grid of (gx, gy) threadgroups of `threads` threads. Returns 0, or
// writes a message to `err` (`err_len` bytes) and returns 1.
extern "C" int mtp_emu_dispatch(Invoker invoke, void* const* args, uint32_t gx, uint32_t gy, uint32_t threads,
                                char* err, size_t err_len) {
    if (threads == 0 || threads > MAX_THREADS) {
        std::snprintf(err, err_len, "a threadgroup of %u threads (1 to %u allowed)", threads, MAX_THREADS);
        return 1;
    }
    const uint64_t total = uint64_t(gx) * gy;
    if (total > UINT32_MAX - 64) {
        std::snprintf(err, err_len, "a grid of %u x %u threadgroups (at most 2^32 - 65)", gx, gy);
        return 1;
    }
    Job job;
    job.invoke = invoke;
    job.args = args;
    job.gx = gx;
    job.threads = threads;
    job.total = uint32_t(total);
    if (total > 1 && pool().helpers > 0) {
        pool().run(job);
    } else {
        work(job);
    }
    if (job.failed_group != UINT32_MAX) {
        std::snprintf(err, err_len, "%s", job.error.c_str());
        return 1;
    }
    return 0;
}
