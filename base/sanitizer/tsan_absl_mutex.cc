// ThreadSanitizer's view of absl::Mutex, for the OFFLOAD_SANITIZE=thread build only.
//
// Debian's abseil (libabsl-dev) is a shared library built without TSan: absl::Mutex locks with its
// own atomics and futex calls, which TSan neither sees nor intercepts, so without help every field
// an absl::Mutex guards would be reported as a race. The TSan build links every target with
// `-Wl,--wrap=SYMBOL` for each absl::Mutex and absl::CondVar entry point below (CMakeLists.txt), so
// that our code's calls land here: each wrapper tells TSan about the lock or unlock through its
// mutex annotation API (sanitizer/tsan_interface.h) around the real call (__real_SYMBOL). Locks
// taken inside uninstrumented libraries (gRPC's own) stay invisible, as everything else they do.
//
// Two simplifications, both on the side of fewer reports, never more: a wait (CondVar::Wait,
// Mutex::Await) counts as an unlock and a lock even when it returns at once, and a condition that
// abseil evaluates in the unlocking thread runs outside the annotated critical section, which TSan
// does not check (it is between pre- and post-annotations, where TSan ignores accesses).
//
// The symbols are those of Debian 12's abseil 20220623 (inline namespace absl::debian3); a linker
// error naming __real_... means the abseil version changed and the list needs its new names.

#include <sanitizer/tsan_interface.h>

#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace {

// An exclusive (flags 0) or shared (__tsan_mutex_read_lock) lock of mu is about to be taken and
// then was taken.
void PreLock(void* mu, unsigned flags) { __tsan_mutex_pre_lock(mu, flags); }
void PostLock(void* mu, unsigned flags) { __tsan_mutex_post_lock(mu, flags, 0); }
void PreUnlock(void* mu, unsigned flags) { __tsan_mutex_pre_unlock(mu, flags); }
void PostUnlock(void* mu, unsigned flags) { __tsan_mutex_post_unlock(mu, flags); }

// A wait that gives mu up and takes it back (exclusively) before it returns.
void WaitBegins(void* mu) {
  PreUnlock(mu, 0);
  PostUnlock(mu, 0);
}
void WaitEnds(void* mu) {
  PreLock(mu, 0);
  PostLock(mu, 0);
}

}  // namespace

// The real functions: this-pointer first, as the Itanium C++ ABI passes it.
#define OFFLOAD_MU(name) _ZN4absl7debian35Mutex##name
#define OFFLOAD_CV(name) _ZN4absl7debian37CondVar##name
#define OFFLOAD_REAL(sym) __real_##sym
#define OFFLOAD_WRAP(sym) __wrap_##sym

using absl::Condition;
using absl::CondVar;
using absl::Duration;
using absl::Mutex;
using absl::Time;

// Expands the symbol macro before pasting the __real_/__wrap_ prefix.
#define OFFLOAD_R(sym) OFFLOAD_REAL(sym)
#define OFFLOAD_W(sym) OFFLOAD_WRAP(sym)

extern "C" {

// Declarations of the originals (the linker binds __real_X to X).
void OFFLOAD_R(OFFLOAD_MU(4LockEv))(Mutex* mu);
void OFFLOAD_R(OFFLOAD_MU(6UnlockEv))(Mutex* mu);
bool OFFLOAD_R(OFFLOAD_MU(7TryLockEv))(Mutex* mu);
void OFFLOAD_R(OFFLOAD_MU(10ReaderLockEv))(Mutex* mu);
void OFFLOAD_R(OFFLOAD_MU(12ReaderUnlockEv))(Mutex* mu);
bool OFFLOAD_R(OFFLOAD_MU(13ReaderTryLockEv))(Mutex* mu);
void OFFLOAD_R(OFFLOAD_MU(5AwaitERKNS0_9ConditionE))(Mutex* mu, const Condition& c);
bool OFFLOAD_R(OFFLOAD_MU(16AwaitWithTimeoutERKNS0_9ConditionENS0_8DurationE))(Mutex* mu,
                                                                               const Condition& c,
                                                                               Duration t);
bool OFFLOAD_R(OFFLOAD_MU(17AwaitWithDeadlineERKNS0_9ConditionENS0_4TimeE))(Mutex* mu,
                                                                            const Condition& c,
                                                                            Time d);
void OFFLOAD_R(OFFLOAD_MU(8LockWhenERKNS0_9ConditionE))(Mutex* mu, const Condition& c);
bool OFFLOAD_R(OFFLOAD_MU(19LockWhenWithTimeoutERKNS0_9ConditionENS0_8DurationE))(
    Mutex* mu, const Condition& c, Duration t);
bool OFFLOAD_R(OFFLOAD_MU(20LockWhenWithDeadlineERKNS0_9ConditionENS0_4TimeE))(Mutex* mu,
                                                                               const Condition& c,
                                                                               Time d);
void OFFLOAD_R(OFFLOAD_MU(14ReaderLockWhenERKNS0_9ConditionE))(Mutex* mu, const Condition& c);
void OFFLOAD_R(OFFLOAD_MU(D1Ev))(Mutex* mu);
void OFFLOAD_R(OFFLOAD_CV(4WaitEPNS0_5MutexE))(CondVar* cv, Mutex* mu);
bool OFFLOAD_R(OFFLOAD_CV(15WaitWithTimeoutEPNS0_5MutexENS0_8DurationE))(CondVar* cv, Mutex* mu,
                                                                         Duration t);
bool OFFLOAD_R(OFFLOAD_CV(16WaitWithDeadlineEPNS0_5MutexENS0_4TimeE))(CondVar* cv, Mutex* mu,
                                                                      Time d);

void OFFLOAD_W(OFFLOAD_MU(4LockEv))(Mutex* mu) {
  PreLock(mu, 0);
  OFFLOAD_R(OFFLOAD_MU(4LockEv))(mu);
  PostLock(mu, 0);
}

void OFFLOAD_W(OFFLOAD_MU(6UnlockEv))(Mutex* mu) {
  PreUnlock(mu, 0);
  OFFLOAD_R(OFFLOAD_MU(6UnlockEv))(mu);
  PostUnlock(mu, 0);
}

bool OFFLOAD_W(OFFLOAD_MU(7TryLockEv))(Mutex* mu) {
  __tsan_mutex_pre_lock(mu, __tsan_mutex_try_lock);
  const bool locked = OFFLOAD_R(OFFLOAD_MU(7TryLockEv))(mu);
  __tsan_mutex_post_lock(mu, __tsan_mutex_try_lock | (locked ? 0 : __tsan_mutex_try_lock_failed),
                         0);
  return locked;
}

void OFFLOAD_W(OFFLOAD_MU(10ReaderLockEv))(Mutex* mu) {
  PreLock(mu, __tsan_mutex_read_lock);
  OFFLOAD_R(OFFLOAD_MU(10ReaderLockEv))(mu);
  PostLock(mu, __tsan_mutex_read_lock);
}

void OFFLOAD_W(OFFLOAD_MU(12ReaderUnlockEv))(Mutex* mu) {
  PreUnlock(mu, __tsan_mutex_read_lock);
  OFFLOAD_R(OFFLOAD_MU(12ReaderUnlockEv))(mu);
  PostUnlock(mu, __tsan_mutex_read_lock);
}

bool OFFLOAD_W(OFFLOAD_MU(13ReaderTryLockEv))(Mutex* mu) {
  const unsigned flags = __tsan_mutex_read_lock | __tsan_mutex_try_lock;
  __tsan_mutex_pre_lock(mu, flags);
  const bool locked = OFFLOAD_R(OFFLOAD_MU(13ReaderTryLockEv))(mu);
  __tsan_mutex_post_lock(mu, flags | (locked ? 0 : __tsan_mutex_try_lock_failed), 0);
  return locked;
}

void OFFLOAD_W(OFFLOAD_MU(5AwaitERKNS0_9ConditionE))(Mutex* mu, const Condition& c) {
  WaitBegins(mu);
  OFFLOAD_R(OFFLOAD_MU(5AwaitERKNS0_9ConditionE))(mu, c);
  WaitEnds(mu);
}

bool OFFLOAD_W(OFFLOAD_MU(16AwaitWithTimeoutERKNS0_9ConditionENS0_8DurationE))(Mutex* mu,
                                                                               const Condition& c,
                                                                               Duration t) {
  WaitBegins(mu);
  const bool met =
      OFFLOAD_R(OFFLOAD_MU(16AwaitWithTimeoutERKNS0_9ConditionENS0_8DurationE))(mu, c, t);
  WaitEnds(mu);
  return met;
}

bool OFFLOAD_W(OFFLOAD_MU(17AwaitWithDeadlineERKNS0_9ConditionENS0_4TimeE))(Mutex* mu,
                                                                            const Condition& c,
                                                                            Time d) {
  WaitBegins(mu);
  const bool met = OFFLOAD_R(OFFLOAD_MU(17AwaitWithDeadlineERKNS0_9ConditionENS0_4TimeE))(mu, c, d);
  WaitEnds(mu);
  return met;
}

void OFFLOAD_W(OFFLOAD_MU(8LockWhenERKNS0_9ConditionE))(Mutex* mu, const Condition& c) {
  PreLock(mu, 0);
  OFFLOAD_R(OFFLOAD_MU(8LockWhenERKNS0_9ConditionE))(mu, c);
  PostLock(mu, 0);
}

bool OFFLOAD_W(OFFLOAD_MU(19LockWhenWithTimeoutERKNS0_9ConditionENS0_8DurationE))(
    Mutex* mu, const Condition& c, Duration t) {
  PreLock(mu, 0);
  const bool met =
      OFFLOAD_R(OFFLOAD_MU(19LockWhenWithTimeoutERKNS0_9ConditionENS0_8DurationE))(mu, c, t);
  PostLock(mu, 0);
  return met;
}

bool OFFLOAD_W(OFFLOAD_MU(20LockWhenWithDeadlineERKNS0_9ConditionENS0_4TimeE))(Mutex* mu,
                                                                               const Condition& c,
                                                                               Time d) {
  PreLock(mu, 0);
  const bool met =
      OFFLOAD_R(OFFLOAD_MU(20LockWhenWithDeadlineERKNS0_9ConditionENS0_4TimeE))(mu, c, d);
  PostLock(mu, 0);
  return met;
}

void OFFLOAD_W(OFFLOAD_MU(14ReaderLockWhenERKNS0_9ConditionE))(Mutex* mu, const Condition& c) {
  PreLock(mu, __tsan_mutex_read_lock);
  OFFLOAD_R(OFFLOAD_MU(14ReaderLockWhenERKNS0_9ConditionE))(mu, c);
  PostLock(mu, __tsan_mutex_read_lock);
}

// A destroyed mutex's memory may hold a new one later; TSan forgets this one.
void OFFLOAD_W(OFFLOAD_MU(D1Ev))(Mutex* mu) {
  __tsan_mutex_destroy(mu, 0);
  OFFLOAD_R(OFFLOAD_MU(D1Ev))(mu);
}

void OFFLOAD_W(OFFLOAD_CV(4WaitEPNS0_5MutexE))(CondVar* cv, Mutex* mu) {
  WaitBegins(mu);
  OFFLOAD_R(OFFLOAD_CV(4WaitEPNS0_5MutexE))(cv, mu);
  WaitEnds(mu);
}

bool OFFLOAD_W(OFFLOAD_CV(15WaitWithTimeoutEPNS0_5MutexENS0_8DurationE))(CondVar* cv, Mutex* mu,
                                                                         Duration t) {
  WaitBegins(mu);
  const bool timed_out =
      OFFLOAD_R(OFFLOAD_CV(15WaitWithTimeoutEPNS0_5MutexENS0_8DurationE))(cv, mu, t);
  WaitEnds(mu);
  return timed_out;
}

bool OFFLOAD_W(OFFLOAD_CV(16WaitWithDeadlineEPNS0_5MutexENS0_4TimeE))(CondVar* cv, Mutex* mu,
                                                                      Time d) {
  WaitBegins(mu);
  const bool timed_out =
      OFFLOAD_R(OFFLOAD_CV(16WaitWithDeadlineEPNS0_5MutexENS0_4TimeE))(cv, mu, d);
  WaitEnds(mu);
  return timed_out;
}

}  // extern "C"
