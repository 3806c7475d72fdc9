# The CUDA executor, jaxccl._native_cuda (included by the top-level CMakeLists.txt after jaxccl_table).
#   JAXCCL_CUDA=AUTO (default) builds it when nvcc is found AND a GPU is visible (`nvidia-smi -L` lists one),
#   ON always builds it (fails without nvcc; tests/gpu/build_check.sh uses it to check that CUDA compiles),
#   OFF never does.
#   JAXCCL_PLUGIN=ON builds it alone, as jaxccl_cuda12_plugin._native_cuda: the jaxccl-cuda12-plugin package
#   (plugins/cuda12), which jaxccl loads in place of its own jaxccl._native_cuda. Nothing else is built then.
# The compiler is the CUDA toolkit's nvcc (CUDACXX, CMAKE_CUDA_COMPILER or PATH): the nvidia-cuda-nvcc-cu12
# wheel ships ptxas and libnvvm but no nvcc. The CUDA runtime is linked statically, so the module needs
# only the driver at run time. CMAKE_CUDA_ARCHITECTURES defaults to "80;90" (A100, H100: SASS and PTX).
set(JAXCCL_CUDA "AUTO" CACHE STRING "Build the CUDA executor: AUTO, ON or OFF")
set_property(CACHE JAXCCL_CUDA PROPERTY STRINGS AUTO ON OFF)
option(JAXCCL_PLUGIN "Build only the CUDA executor, as jaxccl_cuda12_plugin._native_cuda (plugins/cuda12)" OFF)
set(JAXCCL_PLUGIN_CUDA_MAJOR "12" CACHE STRING "The CUDA major version the plugin package is named for")
string(TOUPPER "${JAXCCL_CUDA}" _jaxccl_cuda)
if(NOT _jaxccl_cuda MATCHES "^(AUTO|ON|OFF|TRUE|FALSE|1|0|YES|NO)$")
  message(FATAL_ERROR "JAXCCL_CUDA must be AUTO, ON or OFF, got '${JAXCCL_CUDA}'")
endif()
if(JAXCCL_PLUGIN)
  set(_jaxccl_cuda ON)
  set(_jaxccl_cuda_destination jaxccl_cuda12_plugin)
else()
  set(_jaxccl_cuda_destination jaxccl)
endif()

set(_jaxccl_build_cuda OFF)
if(_jaxccl_cuda MATCHES "^(ON|TRUE|1|YES)$")
  include(CheckLanguage)
  check_language(CUDA)
  if(NOT CMAKE_CUDA_COMPILER)
    message(FATAL_ERROR "JAXCCL_CUDA=ON (or JAXCCL_PLUGIN=ON) but no CUDA compiler (nvcc) was found: install the "
                        "CUDA toolkit, or name its nvcc in CUDACXX")
  endif()
  set(_jaxccl_build_cuda ON)
elseif(_jaxccl_cuda STREQUAL "AUTO")
  # The GPU first: probing for nvcc (check_language) costs seconds, wasted on a machine without a GPU.
  execute_process(COMMAND nvidia-smi -L RESULT_VARIABLE _smi_rc OUTPUT_VARIABLE _smi_out ERROR_QUIET)
  if(_smi_rc EQUAL 0 AND _smi_out MATCHES "GPU")
    include(CheckLanguage)
    check_language(CUDA)
    if(CMAKE_CUDA_COMPILER)
      set(_jaxccl_build_cuda ON)
    else()
      message(STATUS "jaxccl: a GPU is visible but no nvcc was found; building the CPU executor only")
    endif()
  else()
    message(STATUS "jaxccl: no GPU visible (nvidia-smi -L); JAXCCL_CUDA=ON builds the CUDA executor anyway")
  endif()
endif()

if(_jaxccl_build_cuda)
  if(NOT DEFINED CMAKE_CUDA_ARCHITECTURES)
    set(CMAKE_CUDA_ARCHITECTURES "80;90")
  endif()
  enable_language(CUDA)
  set(CMAKE_CUDA_STANDARD 17)
  set(CMAKE_CUDA_STANDARD_REQUIRED ON)
  find_package(CUDAToolkit REQUIRED)
  message(STATUS "jaxccl: building the CUDA executor as ${_jaxccl_cuda_destination}._native_cuda "
                 "(nvcc ${CMAKE_CUDA_COMPILER_VERSION}, architectures ${CMAKE_CUDA_ARCHITECTURES})")
  if(JAXCCL_PLUGIN AND NOT CUDAToolkit_VERSION_MAJOR STREQUAL JAXCCL_PLUGIN_CUDA_MAJOR)
    message(WARNING "jaxccl-cuda${JAXCCL_PLUGIN_CUDA_MAJOR}-plugin is being built with CUDA ${CUDAToolkit_VERSION}: "
                    "the module runs where the driver supports CUDA ${CUDAToolkit_VERSION_MAJOR}")
  endif()

  # The kernel, the FFI handlers and the memory of launches across processes go through nvcc; the nanobind
  # glue through the host compiler. The proxy itself lives in jaxccl._native (reached through host/core_api.h).
  add_library(jaxccl_cuda_impl STATIC kernels/interpreter.cu kernels/handler.cu kernels/launch.cu
                                     kernels/mapped_memory.cu kernels/measure.cu kernels/test_harness.cu)
  target_include_directories(jaxccl_cuda_impl SYSTEM PRIVATE ${XLA_FFI_INCLUDE_DIR})
  target_include_directories(jaxccl_cuda_impl PRIVATE ${CMAKE_CURRENT_SOURCE_DIR}/xla_ffi
                                                      ${CMAKE_CURRENT_SOURCE_DIR}/kernels)
  target_compile_options(jaxccl_cuda_impl
                         PRIVATE $<$<COMPILE_LANGUAGE:CUDA>:-Xcompiler=-Wall,-Wextra,-Wno-unused-parameter>)
  target_link_libraries(jaxccl_cuda_impl PUBLIC CUDA::cudart_static)

  nanobind_add_module(_native_cuda NB_STATIC kernels/cuda_module.cc)
  target_include_directories(_native_cuda PRIVATE ${CMAKE_CURRENT_SOURCE_DIR}/kernels)
  target_link_libraries(_native_cuda PRIVATE jaxccl_cuda_impl jaxccl_table Threads::Threads)
  target_compile_options(_native_cuda PRIVATE ${JAXCCL_WARNINGS})
  install(TARGETS _native_cuda LIBRARY DESTINATION ${_jaxccl_cuda_destination})
else()
  message(STATUS "jaxccl: building the CPU executor only (JAXCCL_CUDA=${JAXCCL_CUDA})")
endif()
