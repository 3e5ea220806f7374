// Switching between the emulator's fibers (see cuda_emu.h): a saved context, prepared to start
// a function on a stack of its own, and the switch from the running context to another.
//
// On x86-64 the switch is written here: it saves the callee-saved registers, the SSE and x87
// control words and the stack pointer, and loads another's. glibc's swapcontext also saves and
// restores the signal mask, a system call per switch, and the whole floating-point environment:
// it took three quarters of the emulator's time, and a kernel switches at every barrier and
// shuffle. Elsewhere ucontext remains.
#pragma once

#include <cstddef>
#include <cstdint>

#if !defined(__x86_64__)
#include <ucontext.h>
#endif

#if defined(__x86_64__)
// pagedserve_emu_fiber_switch(void** save_sp, void* load_sp): pushes the callee-saved registers
// and the control words on the running stack, stores the stack pointer in *save_sp, then pops
// the same from load_sp's stack and returns into that context. Weak and hidden: every translation
// unit that includes this header assembles the same definition, and the linker keeps one per
// module.
asm(R"(
  .text
  .p2align 4
  .weak pagedserve_emu_fiber_switch
  .hidden pagedserve_emu_fiber_switch
  .type pagedserve_emu_fiber_switch, @function
pagedserve_emu_fiber_switch:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  subq $8, %rsp
  stmxcsr (%rsp)
  fnstcw 4(%rsp)
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  ldmxcsr (%rsp)
  fldcw 4(%rsp)
  addq $8, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
  .size pagedserve_emu_fiber_switch, .-pagedserve_emu_fiber_switch
)");
extern "C" void pagedserve_emu_fiber_switch(void** save_sp, void* load_sp);
#endif

namespace pagedserve_emu {

class FiberContext {
 public:
  // Makes the first switch to this context run entry() on [stack_bottom, stack_bottom +
  // stack_bytes). entry must never return: it ends by switching to another context.
  void prepare(char* stack_bottom, size_t stack_bytes, void (*entry)()) {
#if defined(__x86_64__)
    auto top = reinterpret_cast<uintptr_t>(stack_bottom + stack_bytes) & ~uintptr_t{15};
    auto* slot = reinterpret_cast<uint64_t*>(top);
    *--slot = 0;  // entry's return address: none. entry starts with rsp = 8 (mod 16), as a call's.
    *--slot = reinterpret_cast<uint64_t>(entry);  // where the switch's ret goes
    for (int i = 0; i < 6; ++i) *--slot = 0;      // rbp, rbx, r12 to r15
    uint32_t mxcsr;
    uint16_t x87_control;
    asm volatile("stmxcsr %0" : "=m"(mxcsr));
    asm volatile("fnstcw %0" : "=m"(x87_control));
    *--slot = (static_cast<uint64_t>(x87_control) << 32) | mxcsr;  // as the switch lays them out
    sp_ = slot;
#else
    getcontext(&context_);
    context_.uc_stack.ss_sp = stack_bottom;
    context_.uc_stack.ss_size = stack_bytes;
    context_.uc_link = nullptr;
    makecontext(&context_, entry, 0);
#endif
  }

  // Saves the running context here and runs `to` (from where it last switched away, or from
  // its entry); returns when some context switches back to this one.
  void switch_to(FiberContext& to) {
#if defined(__x86_64__)
    pagedserve_emu_fiber_switch(&sp_, to.sp_);
#else
    swapcontext(&context_, &to.context_);
#endif
  }

 private:
#if defined(__x86_64__)
  void* sp_ = nullptr;
#else
  ucontext_t context_;
#endif
};

}  // namespace pagedserve_emu
