# Installs the built fsdp into a scratch prefix, then configures, builds and runs tests/consumer
# against it, as a user's project would.
file(REMOVE_RECURSE "${WORK_DIR}")
file(MAKE_DIRECTORY "${WORK_DIR}")
function(run_step)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE result OUTPUT_VARIABLE output ERROR_VARIABLE output)
  if(NOT result EQUAL 0)
    message(FATAL_ERROR "consumer test step failed (${result}): ${ARGN}\n${output}")
  endif()
  message(STATUS "${output}")
endfunction()
run_step(${CMAKE_COMMAND} --install "${FSDP_BUILD_DIR}" --prefix "${WORK_DIR}/prefix")
# Only fsdp's prefix: its package config finds the libtorch it was built with.
run_step(${CMAKE_COMMAND} -S "${CONSUMER_SOURCE_DIR}" -B "${WORK_DIR}/build" -DCMAKE_BUILD_TYPE=Release
         "-DCMAKE_PREFIX_PATH=${WORK_DIR}/prefix")
run_step(${CMAKE_COMMAND} --build "${WORK_DIR}/build")
run_step("${WORK_DIR}/build/consumer")
# Installed files find libtorch by RPATH too.
run_step("${LINKAGE_TEST}" "${TORCH_LIBRARY_DIR}" "${WORK_DIR}/prefix/lib/libfsdp.so" "${WORK_DIR}/prefix/bin/fsdp"
         "${WORK_DIR}/build/consumer")
# An install carries no test hooks (Note [fault injection in saves]): the counting fault points and
# their variables live only in the tests' preloaded library, which is not installed.
file(STRINGS "${WORK_DIR}/prefix/lib/libfsdp.so" fault_strings REGEX "FSDP_TEST_FAULT")
if(fault_strings)
  message(FATAL_ERROR "the installed libfsdp.so holds the test-only fault points: ${fault_strings}")
endif()
file(GLOB_RECURSE installed_fault_points "${WORK_DIR}/prefix/*fault_points*")
if(installed_fault_points)
  message(FATAL_ERROR "the install holds the tests' fault library: ${installed_fault_points}")
endif()
