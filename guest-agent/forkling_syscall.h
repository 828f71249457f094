/* forkling_syscall.h: one raw x86-64 system call, for the process engine's
 * freestanding helpers (forkling_spawn.c, forkling_reclaim.c), which link no
 * libc: it returns the result, or -errno (nothing writes errno). */
#ifndef FORKLING_SYSCALL_H
#define FORKLING_SYSCALL_H
#if defined(__x86_64__)
static long sc(long n, long a, long b, long c, long d, long e, long f) {
  long r;
  register long r10 __asm__("r10") = d;
  register long r8 __asm__("r8") = e;
  register long r9 __asm__("r9") = f;
  __asm__ volatile("syscall" : "=a"(r) : "a"(n), "D"(a), "S"(b), "d"(c), "r"(r10), "r"(r8), "r"(r9) : "rcx", "r11", "memory");
  return r;
}
#endif
#endif
