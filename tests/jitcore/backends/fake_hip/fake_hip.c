/* A stand-in for libamdhip64 and libhiprtc: just the entry points jitcore's HIP backend calls,
 * with the C signatures of HIP's hip_runtime_api.h / hiprtc.h. It records what it is given in
 * globals the test reads back through ctypes, so the test checks that hip-python's calling
 * conventions, as jitcore uses them, reach C with the right values. It computes nothing.
 *
 * Built by test_hip_fake_driver.py as libamdhip64.so, with libhiprtc.so a symlink to it. */
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef struct { uint32_t x, y, z; } dim3;
typedef struct {
  dim3 blockDim; void** extra; void* func; dim3 gridDim; void** kernelParams; unsigned int sharedMemBytes;
} hipKernelNodeParams;
typedef struct {
  void* dst; unsigned int elementSize; size_t height; size_t pitch; unsigned int value; size_t width;
} hipMemsetParams;

enum { hipSuccess = 0, hipErrorInvalidValue = 1 };
/* offsetof(hipDeviceProp_tR0600, gcnArchName) on x86-64, from the struct in ROCm/HIP's
 * include/hip/hip_runtime_api.h (compiled once with offsetof). */
#define GCN_ARCH_NAME_OFFSET 1160

/* ---- what the test reads back --------------------------------------------------------- */
int fake_current_device = 0;
int fake_set_device_calls = 0;
unsigned long long fake_launch[12];  /* f, gx, gy, gz, bx, by, bz, shared, stream, params, extra, count */
unsigned char fake_launch_param0[8];
const void* fake_loaded_image = 0;
char fake_function_name[256];
unsigned long long fake_graph_launch[3];  /* exec, stream, count */
char fake_options[4096];
int fake_destroyed = 0, fake_destroy_bad = 0;
unsigned long long fake_set_exec = 0, fake_set_node = 0;
hipKernelNodeParams fake_set_params;
unsigned char fake_set_param_bytes[12];

/* ---- runtime --------------------------------------------------------------------------- */
int hipInit(unsigned int flags) { (void)flags; return hipSuccess; }
int hipGetDevice(int* device) { *device = fake_current_device; return hipSuccess; }
int hipSetDevice(int device) { fake_current_device = device; fake_set_device_calls++; return hipSuccess; }
int hipDeviceGetAttribute(int* value, int attribute, int device) { (void)device; *value = 1000 + attribute; return hipSuccess; }
int hipGetDevicePropertiesR0600(void* props, int device) {
  (void)device;
  strcpy((char*)props + GCN_ARCH_NAME_OFFSET, "gfx942:sramecc+:xnack-");
  return hipSuccess;
}
const char* hipGetErrorString(int error) { return error == hipErrorInvalidValue ? "fake: invalid value" : "fake: other"; }
const char* hipGetErrorName(int error) { return error == hipErrorInvalidValue ? "hipErrorInvalidValue" : "other"; }
int hipModuleLoadData(void** module, const void* image) { fake_loaded_image = image; *module = (void*)0x5000; return hipSuccess; }
int hipModuleGetFunction(void** function, void* module, const char* name) {
  if (module != (void*)0x5000) return hipErrorInvalidValue;
  strncpy(fake_function_name, name, sizeof fake_function_name - 1);
  *function = (void*)0x6000;
  return hipSuccess;
}
int hipFuncGetAttribute(int* value, int attribute, void* function) {
  if (function != (void*)0x6000) return hipErrorInvalidValue;
  *value = 2000 + attribute;
  return hipSuccess;
}
int hipModuleLaunchKernel(void* f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
                          unsigned shared, void* stream, void** params, void** extra) {
  unsigned long long values[11] = {(uintptr_t)f, gx, gy, gz, bx, by, bz, shared, (uintptr_t)stream,
                                   (uintptr_t)params, (uintptr_t)extra};
  memcpy(fake_launch, values, sizeof values);
  fake_launch[11]++;
  if (params) memcpy(fake_launch_param0, params[0], 8);
  return gx == 999 ? hipErrorInvalidValue : hipSuccess;
}
int hipDeviceSynchronize(void) { return hipSuccess; }
int hipGraphLaunch(void* exec, void* stream) {
  fake_graph_launch[0] = (uintptr_t)exec; fake_graph_launch[1] = (uintptr_t)stream; fake_graph_launch[2]++;
  return exec == (void*)0x999 ? hipErrorInvalidValue : hipSuccess;
}

/* ---- a captured graph: kernel (kernelParams), memcpy, memset, kernel (extra), host ---------- */
typedef struct { int type; hipKernelNodeParams kernel; hipMemsetParams memset; } FakeNode;
static uint64_t arg0 = 0x1122334455667788ull;
static int32_t arg1 = -5;
static void* kernel_params[2] = {&arg0, &arg1};
static unsigned char kernargs[16] = {7, 0, 0, 0, 0, 0, 0, 0, 0xbc, 0x0a, 0, 0, 0, 0, 0, 0};
static size_t kernargs_size = sizeof kernargs;
static void* extra[5] = {(void*)1, kernargs, (void*)2, &kernargs_size, (void*)0};
static FakeNode nodes[5] = {
  {0, {{128, 1, 1}, 0, (void*)0x6000, {4, 2, 1}, kernel_params, 256}, {0}},
  {1, {{0}}, {0}},
  {2, {{0}}, {(void*)0xdead0000, 4, 1, 0, 0, 64}},
  {0, {{64, 1, 1}, extra, (void*)0x6100, {8, 1, 1}, 0, 0}, {0}},
  {3, {{0}}, {0}},
};

int hipGraphGetNodes(void* graph, void** out, size_t* count) {  /* the semantics of ROCm's clr */
  size_t n = sizeof nodes / sizeof nodes[0];
  if (graph != (void*)0x7000 || count == 0) return hipErrorInvalidValue;
  if (out == 0) { *count = n; return hipSuccess; }
  for (size_t i = 0; i < *count; i++) out[i] = i < n ? (void*)&nodes[i] : 0;
  if (*count > n) *count = n;
  return hipSuccess;
}
int hipGraphNodeGetType(void* node, int* type) { *type = ((FakeNode*)node)->type; return hipSuccess; }
int hipGraphKernelNodeGetParams(void* node, hipKernelNodeParams* params) {
  if (((FakeNode*)node)->type != 0) return hipErrorInvalidValue;
  *params = ((FakeNode*)node)->kernel;
  return hipSuccess;
}
int hipGraphMemsetNodeGetParams(void* node, hipMemsetParams* params) { *params = ((FakeNode*)node)->memset; return hipSuccess; }
int hipGraphExecKernelNodeSetParams(void* exec, void* node, const hipKernelNodeParams* params) {
  if (params == 0 || params->func == 0) return hipErrorInvalidValue;
  fake_set_exec = (uintptr_t)exec; fake_set_node = (uintptr_t)node; fake_set_params = *params;
  memcpy(fake_set_param_bytes, params->kernelParams[0], 8);
  memcpy(fake_set_param_bytes + 8, params->kernelParams[1], 4);
  return hipSuccess;
}

/* ---- hiprtc ----------------------------------------------------------------------------- */
typedef struct { char* source; char names[4][128]; char lowered[4][160]; int count; char log[256]; char code[4096]; } Program;
static Program* last_program = 0;

int hiprtcVersion(int* major, int* minor) { *major = 6; *minor = 2; return 0; }
int hiprtcCreateProgram(Program** program, const char* source, const char* name, int n, const char** headers,
                        const char** include_names) {
  (void)name; (void)n; (void)headers; (void)include_names;
  Program* p = calloc(1, sizeof *p);
  p->source = strdup(source);
  *program = last_program = p;
  return 0;
}
int hiprtcAddNameExpression(Program* p, const char* expression) {
  if (p != last_program || p->count == 4) return 3;
  strncpy(p->names[p->count], expression, 127);
  strcpy(p->lowered[p->count], "_lowered_");
  strncat(p->lowered[p->count++], expression, 127);
  return 0;
}
int hiprtcCompileProgram(Program* p, int n, const char** options) {
  size_t used = 0;
  fake_options[0] = 0;
  for (int i = 0; i < n; i++) {
    size_t len = strlen(options[i]);
    if (used + len + 2 >= sizeof fake_options) break;
    memcpy(fake_options + used, options[i], len);
    used += len;
    fake_options[used++] = '\n';
    fake_options[used] = 0;
  }
  if (strstr(p->source, "#error")) { strcpy(p->log, "kernel.cu:2:2: error: boom\n"); return 6; }
  strcpy(p->code, "CODE:");
  strncat(p->code, fake_options, sizeof p->code - 6);
  return 0;
}
int hiprtcGetProgramLogSize(Program* p, size_t* size) { *size = strlen(p->log) + 1; return 0; }
int hiprtcGetProgramLog(Program* p, char* log) { strcpy(log, p->log); return 0; }
int hiprtcGetLoweredName(Program* p, const char* expression, const char** lowered) {
  for (int i = 0; i < p->count; i++)
    if (strcmp(p->names[i], expression) == 0) { *lowered = p->lowered[i]; return 0; }
  return 10;
}
int hiprtcGetCodeSize(Program* p, size_t* size) { *size = strlen(p->code); return 0; }
int hiprtcGetCode(Program* p, char* code) { memcpy(code, p->code, strlen(p->code)); return 0; }
int hiprtcDestroyProgram(Program** program) {
  if (program == 0 || *program != last_program) { fake_destroy_bad++; return 3; }
  free((*program)->source);
  free(*program);
  *program = last_program = 0;
  fake_destroyed++;
  return 0;
}
