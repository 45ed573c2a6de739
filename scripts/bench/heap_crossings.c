/* Blocks freed on a thread whose glibc arena did not make them: a preloaded malloc/free/realloc wrapper for
   scripts/bench/trainer_split.py --heap, which builds it (cc -O2 -shared -fPIC) and reads heap_dump's lines:
     N threads_counted                                            (more than 64: the counts are not per thread)
     T tid foreign_mallocs frees foreign_frees foreign_reallocs   (one per thread, counted while heap_counting(1))
     L tid library count                                         (the foreign frees by the library that called free)
     P tid count library file:line(function) < its caller's      (the foreign frees made with the GIL held, by
                                                                  the library calling free and the Python line)
   "Foreign": made by another arena than the calling thread's own (threads can share an arena). A block going
   round a thread's cache of freed blocks counts at every reuse: these are events, not distinct blocks.
   The arena of a block is read from glibc's chunk header (x86_64, glibc 2.3x, glibc.malloc.hugetlb unset):
   the size word's bit 2 marks an mmapped block, bit 4 one of a non-main arena, whose heap_info (arena
   pointer first) starts at the block's address rounded down to 64 MiB. calloc and aligned allocations are
   not wrapped (frees of them are counted). __builtin_return_address names free's immediate caller, so a
   library that frees through another's wrapper (numpy through PyMem_RawFree) counts under the wrapper's.
   Built against the running Python's headers (3.11.1 or later: earlier, a dying frame could still be the
   current one); the Python line is read only where the freeing thread holds the GIL, with the garbage
   collector paused and any pending exception kept. It may make frame objects inside free, which are
   allocated and freed on that thread too: a diagnostic, not a clean room. */
#define _GNU_SOURCE
#include <Python.h>
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>
extern void *__libc_malloc(size_t);
extern void __libc_free(void *);
extern void *__libc_realloc(void *, size_t);
#define MAXT 64
#define MAXL 24
typedef struct { long tid, fmallocs, frees, foreign, foreign_re; const char *lib[MAXL]; long n[MAXL]; } thread_counts;
static thread_counts T[MAXT];
static int threads;
static volatile int on;
#define NP 512
typedef struct { long tid, n; const char *lib; char where[160]; } python_line;
static python_line P[NP];

/* Weak: a program that inherits LD_PRELOAD without libpython still loads this (the Python part then sleeps). */
#pragma weak Py_IsInitialized
#pragma weak PyGILState_Check
#pragma weak PyEval_GetFrame
#pragma weak PyFrame_GetCode
#pragma weak PyFrame_GetBack
#pragma weak PyFrame_GetLineNumber
#pragma weak PyUnicode_AsUTF8
#pragma weak PyErr_Fetch
#pragma weak PyErr_Restore
#pragma weak PyGC_Disable
#pragma weak PyGC_Enable
#pragma weak _Py_Dealloc

/* Called under busy: what Python allocates here is not counted. */
static void count_python_line(long tid, const char *lib) {
  if (!Py_IsInitialized || !Py_IsInitialized() || !PyGILState_Check()) return;
  PyObject *type, *value, *traceback;
  PyErr_Fetch(&type, &value, &traceback);  /* an exception being unwound stays the caller's */
  int gc_was_on = PyGC_Disable();          /* a frame object made here must not start a collection */
  char where[160] = "";
  int len = 0;
  PyFrameObject *f = PyEval_GetFrame();
  Py_XINCREF(f);
  for (int depth = 0; f && len < (int)sizeof where; depth++) {
    PyCodeObject *code = PyFrame_GetCode(f);
    const char *file = PyUnicode_AsUTF8(code->co_filename), *name = PyUnicode_AsUTF8(code->co_name);
    const char *base = file ? strrchr(file, '/') : NULL;
    len += snprintf(where + len, sizeof where - len, "%s%s:%d(%s)", depth ? " < " : "",
                    base ? base + 1 : (file ? file : "?"), PyFrame_GetLineNumber(f), name ? name : "?");
    Py_DECREF(code);
    PyFrameObject *back = depth < 1 ? PyFrame_GetBack(f) : NULL;  /* the line and its caller */
    Py_DECREF(f);
    f = back;
  }
  Py_XDECREF(f);
  if (gc_was_on) PyGC_Enable();
  PyErr_Restore(type, value, traceback);
  if (!len) return;
  const char *slash = strrchr(lib, '/');
  lib = slash ? slash + 1 : lib;
  unsigned h = (unsigned)tid;
  for (const char *c = where; *c; c++) h = h * 33 + (unsigned char)*c;
  for (const char *c = lib; *c; c++) h = h * 33 + (unsigned char)*c;
  for (int i = 0; i < NP; i++) {  /* the GIL holder is the only writer (heap_dump reads after counting stops) */
    python_line *e = &P[(h + i) % NP];
    if (!e->n) {
      e->tid = tid; e->lib = lib; snprintf(e->where, sizeof e->where, "%s", where); e->n = 1; return;
    }
    if (e->tid == tid && e->lib == lib && !strcmp(e->where, where)) { e->n++; return; }
  }
}
#define TLS __thread __attribute__((tls_model("initial-exec")))  /* no __tls_get_addr, which may malloc */
static TLS int me = -1, busy;
static TLS void *own;
static void *arena_of(void *p) {  /* glibc chunk header: 2 = mmapped, 4 = not the main arena */
  size_t size = ((size_t *)p)[-1];
  if (size & 2) return (void *)1;
  return (size & 4) ? *(void **)(((uintptr_t)p - 16) & ~((64UL << 20) - 1)) : 0;
}
static thread_counts *mine(void) {
  if (me < 0) {
    busy = 1;
    void *q = __libc_malloc(4096); own = arena_of(q); __libc_free(q);  /* above tcache's sizes: from the arena */
    /* past 64 threads the last slot is shared; the dump's N line says so */
    me = __sync_fetch_and_add(&threads, 1); if (me >= MAXT) me = MAXT - 1;
    T[me].tid = syscall(SYS_gettid);
    busy = 0;
  }
  return &T[me];
}
static void count(void *p, void *caller, int re) {
  if (!on || busy || !p) return;
  thread_counts *t = mine();
  void *a = arena_of(p);
  if (a == (void *)1) return;
  if (re) { if (a != own) t->foreign_re++; return; }
  t->frees++;
  if (a == own) return;
  t->foreign++;
  busy = 1;
  Dl_info d; const char *lib = (dladdr(caller, &d) && d.dli_fname) ? d.dli_fname : "?";
  count_python_line(t->tid, lib);
  busy = 0;
  for (int i = 0; i < MAXL; i++) {
    if (!t->lib[i]) t->lib[i] = lib;
    if (t->lib[i] == lib) { t->n[i]++; break; }
  }
}
void free(void *p) { count(p, __builtin_return_address(0), 0); __libc_free(p); }
void *realloc(void *p, size_t n) { count(p, 0, 1); return __libc_realloc(p, n); }
void *malloc(size_t n) {
  void *p = __libc_malloc(n);
  if (on && !busy && p) {
    thread_counts *t = mine();
    void *a = arena_of(p);
    if (a != (void *)1 && a != own) t->fmallocs++;
  }
  return p;
}
void heap_counting(int enable) { on = enable; }
void heap_dump(const char *path) {
  FILE *f = fopen(path, "w");
  if (!f) return;
  fprintf(f, "N\t%d\n", threads);
  for (int i = 0; i < NP; i++)
    if (P[i].n) fprintf(f, "P\t%ld\t%ld\t%s\t%s\n", P[i].tid, P[i].n, P[i].lib, P[i].where);
  for (int i = 0; i < threads && i < MAXT; i++) {
    fprintf(f, "T\t%ld\t%ld\t%ld\t%ld\t%ld\n", T[i].tid, T[i].fmallocs, T[i].frees, T[i].foreign, T[i].foreign_re);
    for (int k = 0; k < MAXL && T[i].lib[k]; k++) fprintf(f, "L\t%ld\t%s\t%ld\n", T[i].tid, T[i].lib[k], T[i].n[k]);
  }
  fclose(f);
}
