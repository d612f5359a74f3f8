-- Workload (a): GET pass-through. No request() function, so wrk sends one pre-built request
-- (the URL's path) as fast as it can, exactly as it would without a script.
local dir = debug.getinfo(1, "S").source:match("^@(.*/)") or "./"
dofile(dir .. "report.lua")
