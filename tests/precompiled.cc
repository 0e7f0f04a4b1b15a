// The translation unit of epf_test_pch, whose precompiled header every test reuses (tests/CMakeLists.txt).
