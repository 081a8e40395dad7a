/* The C ABI as a C compiler sees it (this file is C, not C++): every field of every struct of
 * offload_c.h is where offload_abi_layout() says, with its size, in the same order, and the
 * listed fields tile each struct with nothing but alignment padding between them, so a field
 * added to the header without its row shows. offload_plan_buckets plans as the C++ trainer's
 * planner does and refuses what offload_c.h says it refuses, changing nothing then. */
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "optimizer_client/capi/offload_c.h"

#define STRUCT(s) \
  { #s, NULL, 0, sizeof(s) }
#define FIELD(s, f) \
  { #s, #f, offsetof(s, f), sizeof(((s*)0)->f) }

static const OffloadFieldLayout kHeader[] = {
    STRUCT(OffloadGroup),
    FIELD(OffloadGroup, offset),
    FIELD(OffloadGroup, length),
    FIELD(OffloadGroup, kind),
    FIELD(OffloadGroup, lr),
    FIELD(OffloadGroup, beta1),
    FIELD(OffloadGroup, beta2),
    FIELD(OffloadGroup, eps),
    FIELD(OffloadGroup, weight_decay),

    STRUCT(OffloadConfig),
    FIELD(OffloadConfig, abi_version),
    FIELD(OffloadConfig, job_id),
    FIELD(OffloadConfig, num_params),
    FIELD(OffloadConfig, world_size),
    FIELD(OffloadConfig, rank),
    FIELD(OffloadConfig, create_job),
    FIELD(OffloadConfig, dtype),
    FIELD(OffloadConfig, num_groups),
    FIELD(OffloadConfig, groups),
    FIELD(OffloadConfig, num_shards),
    FIELD(OffloadConfig, shard_addresses),
    FIELD(OffloadConfig, threads),
    FIELD(OffloadConfig, transport),
    FIELD(OffloadConfig, token),
    FIELD(OffloadConfig, tls_ca),
    FIELD(OffloadConfig, tls_cert),
    FIELD(OffloadConfig, tls_key),
    FIELD(OffloadConfig, tls_server_name),
    FIELD(OffloadConfig, call_timeout_seconds),
    FIELD(OffloadConfig, loss_scale_init),
    FIELD(OffloadConfig, loss_scale_window),
    FIELD(OffloadConfig, grad_clip),
    FIELD(OffloadConfig, trace_file),
    FIELD(OffloadConfig, state_tier),
    FIELD(OffloadConfig, adam_form),
    FIELD(OffloadConfig, state_dtype),
    FIELD(OffloadConfig, state_rounding),
    FIELD(OffloadConfig, step_timeout_floor_seconds),

    STRUCT(OffloadNamedTensor),
    FIELD(OffloadNamedTensor, name),
    FIELD(OffloadNamedTensor, offset),
    FIELD(OffloadNamedTensor, ndim),
    FIELD(OffloadNamedTensor, shape),

    STRUCT(OffloadStepReport),
    FIELD(OffloadStepReport, step),
    FIELD(OffloadStepReport, skipped),
    FIELD(OffloadStepReport, loss_scale),
    FIELD(OffloadStepReport, next_loss_scale),
    FIELD(OffloadStepReport, grad_norm),
    FIELD(OffloadStepReport, clip_coef),
    FIELD(OffloadStepReport, grad_multiplier),
    FIELD(OffloadStepReport, adam_step),
    FIELD(OffloadStepReport, skipped_steps),
    FIELD(OffloadStepReport, early_updated),
    FIELD(OffloadStepReport, early_rolled_back),

    STRUCT(OffloadRangeStep),
    FIELD(OffloadRangeStep, offset),
    FIELD(OffloadRangeStep, length),
    FIELD(OffloadRangeStep, t),

    STRUCT(OffloadFieldLayout),
    FIELD(OffloadFieldLayout, struct_name),
    FIELD(OffloadFieldLayout, field),
    FIELD(OffloadFieldLayout, offset),
    FIELD(OffloadFieldLayout, size),
};

static int failures = 0;

#define CHECK(cond, ...)            \
  do {                              \
    if (!(cond)) {                  \
      fprintf(stderr, "FAILED: ");  \
      fprintf(stderr, __VA_ARGS__); \
      fputc('\n', stderr);          \
      ++failures;                   \
    }                               \
  } while (0)

static const char* Str(const char* s) { return s != NULL ? s : "(null)"; }

static int Same(const char* a, const char* b) {
  return (a == NULL && b == NULL) || (a != NULL && b != NULL && strcmp(a, b) == 0);
}

static uint64_t RoundUp(uint64_t n, uint64_t to) { return (n + to - 1) / to * to; }

/* The library's rows are the header's, in order, and nothing more. */
static void TestTheLibraryReportsTheHeadersLayout(void) {
  const OffloadFieldLayout* rows = offload_abi_layout();
  const size_t n = sizeof(kHeader) / sizeof(kHeader[0]);
  size_t k = 0;
  for (; rows[k].struct_name != NULL; ++k) {
    if (k == n) {
      CHECK(0, "row %zu (%s.%s) is beyond the header's %zu rows", k, rows[k].struct_name,
            Str(rows[k].field), n);
      break;
    }
    const OffloadFieldLayout* h = &kHeader[k];
    CHECK(Same(rows[k].struct_name, h->struct_name) && Same(rows[k].field, h->field),
          "row %zu is %s.%s in the library, %s.%s in the header", k, rows[k].struct_name,
          Str(rows[k].field), h->struct_name, Str(h->field));
    CHECK(rows[k].offset == h->offset && rows[k].size == h->size,
          "%s.%s: offset %llu size %llu in the library, offset %llu size %llu in the header",
          h->struct_name, Str(h->field), (unsigned long long)rows[k].offset,
          (unsigned long long)rows[k].size, (unsigned long long)h->offset,
          (unsigned long long)h->size);
  }
  CHECK(k == n, "the library lists %zu rows, the header %zu", k, n);
  CHECK(rows[k].field == NULL && rows[k].offset == 0 && rows[k].size == 0,
        "the table's last row is not all null");
}

/* Each struct's listed fields follow each other with only the padding their alignment needs
 * (every field is a scalar or a pointer: its alignment is its size), and the struct ends after
 * the last one's padding: no field of the header is missing from the list. */
static void TestTheFieldsTileEachStruct(void) {
  const size_t n = sizeof(kHeader) / sizeof(kHeader[0]);
  size_t k = 0;
  while (k < n) {
    const OffloadFieldLayout* whole = &kHeader[k++];
    CHECK(whole->field == NULL, "row %zu should start a struct", k - 1);
    uint64_t end = 0, align = 1;
    for (; k < n && kHeader[k].field != NULL; ++k) {
      const OffloadFieldLayout* f = &kHeader[k];
      CHECK(f->offset == RoundUp(end, f->size),
            "%s.%s is at %llu, right after the field before would be %llu: a field between "
            "them is not listed",
            f->struct_name, f->field, (unsigned long long)f->offset,
            (unsigned long long)RoundUp(end, f->size));
      end = f->offset + f->size;
      if (f->size > align) align = f->size;
    }
    CHECK(whole->size == RoundUp(end, align),
          "%s is %llu bytes, its listed fields end at %llu: a field after them is not listed",
          whole->struct_name, (unsigned long long)whole->size, (unsigned long long)end);
  }
}

static void TestPlanBuckets(void) {
  const uint64_t sizes[] = {3, 4, 5, 2, 6, 1};
  int32_t out[6];
  CHECK(offload_plan_buckets(sizes, 6, 6, out) == 0, "a plan was refused: %s",
        offload_last_error());
  const int32_t expected[] = {0, 0, 1, 1, 2, 3};
  CHECK(memcmp(out, expected, sizeof(out)) == 0, "buckets %d %d %d %d %d %d", out[0], out[1],
        out[2], out[3], out[4], out[5]);

  /* One element: each member alone; a threshold past every sum: one bucket. */
  CHECK(offload_plan_buckets(sizes, 6, 1, out) == 0, "bucket_elements 1 was refused");
  for (int i = 0; i < 6; ++i) CHECK(out[i] == i, "bucket_elements 1: member %d in %d", i, out[i]);
  CHECK(offload_plan_buckets(sizes, 6, UINT64_MAX, out) == 0, "UINT64_MAX was refused");
  for (int i = 0; i < 6; ++i) CHECK(out[i] == 0, "UINT64_MAX: member %d in %d", i, out[i]);
  CHECK(offload_plan_buckets(sizes, 0, 6, out) == 0, "no member was refused");

  /* Refusals: INVALID_ARGUMENT with offload_last_error() saying why, and bucket_of untouched. */
  const uint64_t huge[] = {UINT64_MAX / 2, UINT64_MAX / 2, 2};
  for (int i = 0; i < 6; ++i) out[i] = -7;
  CHECK(offload_plan_buckets(NULL, 6, 6, out) == 3, "null sizes accepted");
  CHECK(offload_plan_buckets(sizes, 6, 6, NULL) == 3, "null bucket_of accepted");
  CHECK(offload_plan_buckets(sizes, -1, 6, out) == 3, "n -1 accepted");
  CHECK(offload_plan_buckets(sizes, 6, 0, out) == 3, "bucket_elements 0 accepted");
  CHECK(strstr(offload_last_error(), "bucket_elements is 0") != NULL, "the error says: %s",
        offload_last_error());
  CHECK(offload_plan_buckets(huge, 3, 6, out) == 3, "sizes past 2^63 - 1 accepted");
  for (int i = 0; i < 6; ++i) CHECK(out[i] == -7, "a refused plan wrote member %d", i);
}

int main(void) {
  TestTheLibraryReportsTheHeadersLayout();
  TestTheFieldsTileEachStruct();
  TestPlanBuckets();
  if (failures == 0)
    printf("PASSED: %zu layout rows, the bucket planner\n", sizeof(kHeader) / sizeof(kHeader[0]));
  return failures == 0 ? 0 : 1;
}
