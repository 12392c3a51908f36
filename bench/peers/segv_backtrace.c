/* Prints a crashing process's native stack (SIGSEGV, SIGBUS, SIGABRT) to stderr, then lets the
 * signal take its default course. For hosts without a debugger (the GPU host has no gdb):
 *   gcc -shared -fPIC -O1 -o libsegv_backtrace.so segv_backtrace.c
 *   LD_PRELOAD=$PWD/libsegv_backtrace.so python3 ...
 * Python's faulthandler, when enabled, runs first (it prints the Python stack) and then hands the
 * signal back to this handler. Symbols are the shared objects' exported ones (addresses for the
 * rest: resolve them with addr2line -e LIB OFFSET). */
#define _GNU_SOURCE
#include <execinfo.h>
#include <signal.h>
#include <unistd.h>

static void DumpStack(int sig) {
  static const char kHeader[] = "segv_backtrace: native stack\n";
  void* frames[64];
  const int count = backtrace(frames, 64);
  (void)!write(STDERR_FILENO, kHeader, sizeof kHeader - 1);
  backtrace_symbols_fd(frames, count, STDERR_FILENO);
  signal(sig, SIG_DFL);
  raise(sig);
}

__attribute__((constructor)) static void Install(void) {
  void* warm[1];
  backtrace(warm, 1); /* loads libgcc's unwinder now, not inside the handler */
  signal(SIGSEGV, DumpStack);
  signal(SIGBUS, DumpStack);
  signal(SIGABRT, DumpStack);
}
