/*
 * replay_support: what the torch-side helper (csrc/jitcore_torch_native.cpp) lends the C replay
 * step (csrc/replay_step.c) and the watch check (csrc/replay_checks.c), in its module's capsule
 * `replay_support`.
 *
 * Why one header with a generated check: the two sides are built apart (the helper per torch
 * build at run time by jitcore.torch_native, the step by setup.py), so either may be a build of
 * another version of this struct. The functions are listed once, in REPLAY_SUPPORT_FIELDS; the
 * struct is made from that list, and so is REPLAY_SUPPORT_LAYOUT, the list as text. The exporter
 * stores that text and the struct's size in the first two members (which every version keeps);
 * the importer, replay_support_from, compares both with its own before it reads anything else,
 * and refuses a helper built from another header with a message saying what to rebuild.
 * Editing the list changes the text: there is no version number to keep in step by hand.
 */
#ifndef REPLAY_SUPPORT_H
#define REPLAY_SUPPORT_H

#include <Python.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#define REPLAY_SUPPORT_CAPSULE "jitcore._torch_native.replay_support"

/* X(return type, name, parameters), in the struct's order:
   - read_data_pointer: a plain tensor's data_ptr() without the method call; 0 where it does not
     read it (anything but a plain tensor, a torch function mode active): the caller asks Python;
   - fresh_output: a replay's handed-out output from its template view, exactly view.detach();
   - storage_use_count: a storage's use count, -1 for anything but a torch storage;
   - read_storage_span: a plain tensor's storage's first byte and size, 0 where it does not;
   - read_tensor_state: what a graph bakes of a tensor it reads where it lies, as words (its
     Python type, data pointer, dispatch keys, dtype, device index, number of dimensions, each
     size, each stride): the count of words (written where it is at most `capacity`), -1 where it
     does not read the tensor (the watch of csrc/replay_checks.c, replay.watch);
   - tensor_states_unlike: the index of the first of `count` tensors whose state is not
     `words[i]` (as read_tensor_state wrote it) or is not read, `count` where every one is. */
#define REPLAY_SUPPORT_FIELDS(X)                                                                                       \
    X(int, read_data_pointer, (PyObject * tensor, uint64_t * address))                                                 \
    X(PyObject *, fresh_output, (PyObject * view))                                                                     \
    X(int64_t, storage_use_count, (PyObject * storage))                                                                \
    X(int, read_storage_span, (PyObject * tensor, uint64_t * base, uint64_t * nbytes))                                 \
    X(Py_ssize_t, read_tensor_state, (PyObject * tensor, int64_t * words, Py_ssize_t capacity))                        \
    X(Py_ssize_t, tensor_states_unlike, (PyObject * const *tensors, const int64_t *const *words, Py_ssize_t count))

#define REPLAY_SUPPORT_MEMBER(type, name, parameters) type(*name) parameters;
#define REPLAY_SUPPORT_TEXT(type, name, parameters) #type " (*" #name ")" #parameters "; "

/* The field list as text: what the exporter stores in `layout` and the importer compares. */
#define REPLAY_SUPPORT_LAYOUT REPLAY_SUPPORT_FIELDS(REPLAY_SUPPORT_TEXT)

typedef struct {
    const char *layout; /* REPLAY_SUPPORT_LAYOUT as the exporter was built: first in every version */
    size_t size;        /* sizeof(replay_support) as the exporter was built: second in every version */
    REPLAY_SUPPORT_FIELDS(REPLAY_SUPPORT_MEMBER)
} replay_support;

/* The struct lent in `capsule`, or NULL with TypeError (not the helper's capsule) or ValueError
   (built from another version of this header, or a function missing) set. `importer` names the
   caller in the messages. */
static inline const replay_support *replay_support_from(PyObject *capsule, const char *importer) {
    if (!PyCapsule_IsValid(capsule, REPLAY_SUPPORT_CAPSULE)) {
        PyErr_Format(PyExc_TypeError, "%s: support must be the torch-side helper's %s capsule, not %.100s", importer,
                     REPLAY_SUPPORT_CAPSULE, Py_TYPE(capsule)->tp_name);
        return NULL;
    }
    const replay_support *support = (const replay_support *)PyCapsule_GetPointer(capsule, REPLAY_SUPPORT_CAPSULE);
    if (support == NULL)
        return NULL;
    if (support->layout == NULL || strcmp(support->layout, REPLAY_SUPPORT_LAYOUT) != 0 ||
        support->size != sizeof(replay_support)) {
        PyErr_Format(PyExc_ValueError,
                     "%s: the torch-side helper was built from another csrc/replay_support.h (its layout \"%.400s\", "
                     "%zu bytes; this build's \"%s\", %zu bytes): rebuild the one that is older "
                     "(python -m jitcore.torch_native, or python setup.py build_ext)",
                     importer, support->layout == NULL ? "(none)" : support->layout, support->size,
                     REPLAY_SUPPORT_LAYOUT, sizeof(replay_support));
        return NULL;
    }
#define REPLAY_SUPPORT_PRESENT(type, name, parameters)                                                                 \
    if (support->name == NULL) {                                                                                       \
        PyErr_Format(PyExc_ValueError, "%s: the torch-side helper lends no %s", importer, #name);                     \
        return NULL;                                                                                                   \
    }
    REPLAY_SUPPORT_FIELDS(REPLAY_SUPPORT_PRESENT)
#undef REPLAY_SUPPORT_PRESENT
    return support;
}

#endif
