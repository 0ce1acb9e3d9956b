// The staged pipeline's entry for npo_cuda_staged_submit (inside the library only).
#pragma once

#include <stddef.h>

#include "npo_cuda.h"

// Enqueue a planned `job`, with `scatter_after` (a load's only, may be NULL): an event on the model's
// stream that every scatter into the KV pages, and the upload of the block ids, wait for, while the
// link copies into the staging slots start at once. With `mark_on` (the model's stream, NULL: the
// caller recorded the event) it is recorded here, after the first link batch where none waits sooner.
int npo_staged_run_job(const npo_staged_job *job, void *scatter_after, void *mark_on, char *msg, size_t msg_len);
